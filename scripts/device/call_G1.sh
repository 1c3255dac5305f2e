#!/usr/bin/env bash
# Device call G1 (2026-12-02, session 5; carry .whl and .dev/): the routing defaults measured in F2 (the GEMV for
# M <= 32 within a 60 MB partials budget, decode attention for up to 32 queries), the 8-bit cache attention with
# 8 elements per lane at GQA 4 (80 registers, was 168), and where a verify step's extra time goes.
#  1. GPU tests of the kernels, batch invariance, multigpu plan, prefill memory;
#  2. the plan-vs-allocator gap, allocation by allocation (scripts/plan_vs_allocator.py);
#  3. bench_gemm --quick: GEMV / mma / dequant + cuBLAS for M = 1..32 (the crossover with the new routing);
#  4. decode step with and without the attention split tickets (one launch per layer fewer);
#  5. verify costs with the new routing, and the per-kernel tables of decode and verify graphs without PDL.
export EXL2_CARRIED_LIBRARY=1
source scripts/device/common.sh
results_dir
t=$(date +%s)
timeout 240 python3 -m pytest tests/kernels tests/serve/test_batch_invariance.py tests/multigpu/test_multigpu_cuda.py \
  tests/engine/test_prefill_memory.py -q -m cuda -p no:cacheprovider --timeout 120 -rf 2>&1 \
  | tee "$R/tests.txt" | grep -E "FAILED|passed|failed|Error" | tail -8
echo "tests $(( $(date +%s) - t )) s"; t=$(date +%s)
timeout 60 python3 scripts/plan_vs_allocator.py > "$R/plan_vs_allocator.txt" 2>&1; head -30 "$R/plan_vs_allocator.txt"
OUT="$R" timeout 150 python3 scripts/bench_gemm.py --quick > "$R/bench_gemm.txt" 2>&1
grep -B2 -A40 "^shape" "$R/bench_gemm.txt" | head -48; tail -3 "$R/bench_gemm.txt"
echo "kernels $(( $(date +%s) - t )) s"; t=$(date +%s)
timeout 80 python3 scripts/profile_decode.py --shapes llama3-8b --variants after,tickets --workdir /tmp/prof \
  --no-check --out "$R" > "$R/profile_tickets.txt" 2>&1; grep -E '########|!!' "$R/profile_tickets.txt" | head -3
timeout 60 python3 scripts/spec_bench.py --skip smollm2 --iters 30 --work-dir /tmp/spec_bench \
  --out "$R/spec_costs.json" 2> "$R/spec_costs.log"; grep 'step costs' "$R/spec_costs.log" | tail -1
EXL2_BACKEND_PDL=0 timeout 70 python3 scripts/spec_bench.py --skip smollm2 --iters 20 --kernels \
  --work-dir /tmp/spec_bench --out "$R/spec_kernels_nopdl.json" 2> "$R/spec_kernels_nopdl.log"
grep 'step costs' "$R/spec_kernels_nopdl.log" | tail -1
python3 - "$R/spec_kernels_nopdl.json" <<'P' | tee "$R/spec_kernels_summary.txt"
import json, sys
k = json.load(open(sys.argv[1]))["costs_8b"].get("kernels", {})
names = sorted({n for t in k.values() for n in t}, key=lambda n: -sum(t.get(n, [0, 0])[-1] for t in k.values()))
print("kernel us/step:", "  ".join(f"{g:>10}" for g in k))
for n in names[:14]:
    print(f"{n[:60]:<60}", "  ".join(f"{k[g][n][-1] if n in k[g] else 0:>10.1f}" for g in k))
P
echo "decode $(( $(date +%s) - t )) s"
pack_results g1
