#!/usr/bin/env bash
# Device call R3 (session 10; carry .whl and .dev/libexl2_kernels.so.gz). The vector gather of R2 lost and is
# gone (the gather is R1's again); this is the session's final library:
#  1. GPU tests of the GEMV paths this session touched (R1 and R2 ran out of time before the end of their lists,
#     with no failure in what ran): fold_down_order, the pre-gathering norm, the chain, batch invariance, the TMA
#     GEMV's gathers and token tiles, fp16 pages through the two-step one-pass attention (the fp16 default now);
#  2. the final figures: the 8B decode step at 1k, verify costs, `bench` at 1k and 32k (fp16, q8, q4).
export EXL2_CARRIED_LIBRARY=1
source scripts/device/common.sh
results_dir
trap '[ -d "$R" ] && pack_results r3' EXIT
T0=$(date +%s)
gpu_tests tests 230 -n 6 tests/kernels/test_fold_down_order_cuda.py tests/kernels/test_gemv_norm.py \
  tests/kernels/test_gemv_chain.py tests/serve/test_batch_invariance.py tests/kernels/test_paged_attention.py \
  tests/kernels/test_exl2_gemm.py -k "online2 or gated or gemv or pregathered or fold or norm or chain or invarian"
echo "tests $(( $(date +%s) - T0 )) s"
decode_step_1k final nochain
grep -A10 "critical path" "$R/prof_final.txt" | head -9
spec_costs final
bench_8b final 120 1024,32768 fp16,q8,q4
echo "total $(( $(date +%s) - T0 )) s"
