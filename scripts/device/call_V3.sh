#!/usr/bin/env bash
# Device call V3 (session 13; carry .whl and .dev/libexl2_kernels.so.gz), the session's final library: 3-bit whole
# fields, scales staged by the smallest group, span splits whose blocks read no run bounds when an item stays in
# one run (V2's span kernel read them through indexed constant loads before its first copy: +0.3-0.5 us per GEMV)
# and compute them in 32-bit arithmetic.
#  1. the 8B decode step at 1k: span twice, balanced once;
#  2. the GEMV GPU tests, verbose (every result named as it comes);
#  3. `bench` at 1k and 32k (fp16 / q8 / q4), verify costs, ExLlamaV2 0.3.2 at 1k beside ours.
export EXL2_CARRIED_LIBRARY=1
source scripts/device/common.sh
begin_call v3
start_exllamav2_jit
kinds() { grep -A14 "by the launch's bit widths" "$R/prof_$1.txt" | grep -E "^(q/k/v|o|gate/up|down|head) "; }
roles() { grep -A7 "GEMVs by role" "$R/prof_$1.txt" | tail -5; }
decode_step_1k span1 nochain; roles span1; kinds span1
decode_step_1k bal1 nochain EXL2_BACKEND_GEMV_SPLITS=balanced; roles bal1
decode_step_1k span2 nochain; roles span2
echo "steps $(( $(date +%s) - T0 )) s"
timeout "$(left 250)" python3 -m pytest -n 14 -v -m cuda -p no:cacheprovider -rf tests/kernels/test_exl2_gemm.py \
  tests/kernels/test_exl2_dequant.py tests/unit/test_gemv_split_plan.py tests/unit/test_kernel_layout.py \
  tests/kernels/test_gemv_norm.py tests/kernels/test_gemv_rope_kv.py tests/kernels/test_fold_down_order_cuda.py \
  tests/kernels/test_gemv_chain.py -k "not llama3_8b" > "$R/kern.txt" 2>&1
grep -cE "PASSED" "$R/kern.txt"; grep -E "FAILED|ERROR|passed|failed" "$R/kern.txt" | grep -v "^\[gw[0-9]*\] .* PASSED" | tail -12
echo "tests $(( $(date +%s) - T0 )) s"
bench_8b final 130 1024,32768 fp16,q8,q4
spec_costs final
echo "bench $(( $(date +%s) - T0 )) s"
if [ "$(left 575)" -gt 90 ]; then
  exllamav2_vs_ours "$(left 575)"
fi
echo "total $(( $(date +%s) - T0 )) s"
