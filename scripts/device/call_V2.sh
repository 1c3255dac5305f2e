#!/usr/bin/env bash
# Device call V2 (session 13; carry .whl and .dev/libexl2_kernels.so.gz): span splits (a GEMV split may cover the
# end of one width run and the start of the next; GEMV_SPLITS=span, the new default) against per-run balanced
# splits, and the GPU tests of the GEMV kernels verbose (V1's run ended at its limit with one failure unnamed).
#  1. the 8B decode step at 1k, span / balanced interleaved twice, each role's GEMV time by bit widths;
#  2. the GEMV, dequant and layout GPU tests, -v (each result named as it comes);
#  3. bench_gemm --m1 with span splits.
export EXL2_CARRIED_LIBRARY=1
source scripts/device/common.sh
begin_call v2
kinds() { grep -A14 "by the launch's bit widths" "$R/prof_$1.txt" | grep -E "^(q/k/v|o|gate/up|down|head) "; }
roles() { grep -A7 "GEMVs by role" "$R/prof_$1.txt" | tail -5; }
decode_step_1k span1 nochain; roles span1; kinds span1
decode_step_1k bal1 nochain EXL2_BACKEND_GEMV_SPLITS=balanced; roles bal1; kinds bal1
decode_step_1k span2 nochain; roles span2
decode_step_1k bal2 nochain EXL2_BACKEND_GEMV_SPLITS=balanced; roles bal2
echo "steps $(( $(date +%s) - T0 )) s"
gpu_tests kern "$(left 400)" -n 12 -v tests/kernels/test_exl2_gemm.py tests/kernels/test_exl2_dequant.py \
  tests/kernels/test_gemv_norm.py tests/kernels/test_gemv_rope_kv.py tests/kernels/test_fold_down_order_cuda.py \
  tests/kernels/test_gemv_chain.py -k "not llama3_8b" tests/unit/test_gemv_split_plan.py tests/unit/test_kernel_layout.py
echo "tests $(( $(date +%s) - T0 )) s"
timeout "$(left 520)" python3 scripts/bench_gemm.py --m1 > "$R/gemm_span.txt" 2>&1; grep "^M1" "$R/gemm_span.txt"
echo "total $(( $(date +%s) - T0 )) s"
