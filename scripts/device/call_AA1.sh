#!/usr/bin/env bash
# Device call AA1 (prepared in session 15, not yet run; carry .whl, .dev/libexl2_kernels.so.gz and
# .dev/libexl2_kernels_{fold4,foldprobe,foldstaged}.so.gz, 43 MB): is a zero-point fold worth having, what the
# attention's reduce launch costs and whether o_proj can take it over, and where a verify step's extra time goes. Libraries against the default (D):
#   V  EXL2_GEMV_FOLD_ZERO=4: Z3's fold on 4-bit runs (bare codes, x summed by one more mma per k-step): lost 1.2%;
#   Q  + EXL2_GEMV_FOLD_PROBE: the same without the sums (results WRONG): the decode without its FP ops and nothing
#      in their place (a 4-bit warp chunk 120 -> 89 SASS instructions, 8 mmas), the most a fold can gain;
#   S  + EXL2_GEMV_FOLD_STAGED: the sums of x per group computed once after the input is staged, read at the flush
#      (89 instructions and 8 mmas in the chunk, a short pass and one block barrier more before it).
# Build each carried variant with `bash scripts/build_variant.sh "MACROS" .dev/libexl2_kernels_<name>.so.gz`.
# Steps:
#  1. the 8B decode step at 1k, D / V / Q / S interleaved twice, GEMV time by role and bit widths;
#  2. the decode step with the attention's split combination left out (EXL2_ATTN_PROBE=1, results WRONG): what the
#     reduce launch costs, the most that combining the splits inside o_proj's input gather could gain (Z2: the
#     reduce holds 76 us of the 2,340 us critical path);
#     Beside it the real thing, EXL2_BACKEND_ATTN_COMBINE_IN_GEMV=1: the attention leaves its partials and o_proj
#     combines them in its input gather (csrc/quant/exl2_gemv_attn.cuh, CudaLinearOp.attn_combined; bit-identical
#     in design, never run on a GPU before this call);
#  3. spec_bench --kernels with D: the critical path of the decode graph and of the k = 4 verify graph (a k = 4
#     verify costs 1.316 decode steps against the 1.15 wanted; which kernels hold the difference was never measured);
#  4. the combination's GPU tests and the attention's with D; the GEMM, norm and fold GPU tests with S (the fold
#     loses the folded down_proj order's bit-identity: test_folded_mlp_is_bit_identical_on_the_gpu[5] is expected
#     to fail).
export EXL2_CARRIED_LIBRARY=1
source scripts/device/common.sh
begin_call aa1
use_libraries V=.dev/libexl2_kernels_fold4.so.gz Q=.dev/libexl2_kernels_foldprobe.so.gz \
  S=.dev/libexl2_kernels_foldstaged.so.gz
interleaved_steps D1 V1 Q1 S1 D2 V2 Q2 S2
cp /tmp/libD.so "$LIB"
decode_step_1k noreduce nochain EXL2_ATTN_PROBE=1
decode_step_1k combine nochain EXL2_BACKEND_ATTN_COMBINE_IN_GEMV=1
attention_paths D1 noreduce combine
echo "mean graph steps: D $(mean_step D) V $(mean_step V) Q $(mean_step Q) S $(mean_step S) ms"
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
echo "elapsed $(( $(date +%s) - T0 )) s"
gpu_tests_verbose combine 120 -n 8 tests/kernels/test_attn_o_proj_cuda.py tests/kernels/test_paged_attention.py
cp /tmp/libS.so "$LIB"
gpu_tests_verbose kernS "$(left 560)" -n 14 tests/kernels/test_exl2_gemm.py tests/kernels/test_fold_down_order_cuda.py \
  tests/kernels/test_gemv_norm.py
cp /tmp/libD.so "$LIB"
echo "total $(( $(date +%s) - T0 )) s"
