#!/usr/bin/env bash
# Device call AA1 (prepared in session 15, not yet run; carry .whl, .dev/libexl2_kernels.so.gz,
# .dev/libexl2_kernels_fold4.so.gz and .dev/libexl2_kernels_foldprobe.so.gz): how much a zero-point fold could gain
# at most, and where a verify step's extra time goes.
#   V  EXL2_GEMV_FOLD_ZERO=4: Z3's fold on 4-bit runs (bare codes, x summed by one more mma per k-step): lost 1.2%;
#   Q  EXL2_GEMV_FOLD_ZERO=4 EXL2_GEMV_FOLD_PROBE: the same without the sums (results WRONG): the decode without its
#      FP ops and nothing in their place (a 4-bit warp chunk 120 -> 89 SASS instructions, 8 mmas). If Q gains little
#      on the 4:1 gate/up, no fold of the zero point is worth building; if it gains, per-group sums of x computed
#      while the input is staged (no extra mma) are the next build.
# Build the carried variants with `bash scripts/build_variant.sh "EXL2_GEMV_FOLD_ZERO=4 EXL2_GEMV_FOLD_PROBE"
# .dev/libexl2_kernels_foldprobe.so.gz` (and EXL2_GEMV_FOLD_ZERO=4 for fold4). Steps:
#  1. the 8B decode step at 1k, D / V / Q interleaved twice, GEMV time by role and bit widths;
#  2. spec_bench --kernels with D: the critical path of the decode graph and of every verify graph (a k = 4 verify
#     costs 1.316 decode steps against the 1.15 wanted; which kernels hold the difference was never measured).
export EXL2_CARRIED_LIBRARY=1
source scripts/device/common.sh
begin_call aa1
use_libraries V=.dev/libexl2_kernels_fold4.so.gz Q=.dev/libexl2_kernels_foldprobe.so.gz
interleaved_steps D1 V1 Q1 D2 V2 Q2
cp /tmp/libD.so "$LIB"
echo "mean graph steps: D $(mean_step D) V $(mean_step V) Q $(mean_step Q) ms"
echo "elapsed $(( $(date +%s) - T0 )) s"
timeout 120 python3 scripts/spec_bench.py --skip smollm2 --iters 30 --kernels --work-dir /tmp/spec_bench \
  --out "$R/spec_kernels.json" > "$R/spec_kernels.txt" 2>&1
python3 - "$R/spec_kernels.json" <<'PY'
import json, sys
crit = json.load(open(sys.argv[1]))["costs_8b"].get("critical", {})
dec = crit.get("decode", {})
for graph in ("decode", "verify_k4"):
    rows = sorted(crit.get(graph, {}).items(), key=lambda kv: -kv[1][1])[:14]
    print(f"-- {graph}: {sum(v[1] for v in crit.get(graph, {}).values()):.0f} us on the critical path")
    for name, (n, us) in rows:
        print(f"{name[:70]:70s} {n:6.1f} {us:8.1f}  (decode {dec.get(name, [0, 0])[1]:8.1f})")
PY
echo "total $(( $(date +%s) - T0 )) s"
