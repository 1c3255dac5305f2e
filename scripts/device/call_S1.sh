#!/usr/bin/env bash
# Device call S1 (prepared in session 10 for the next one; carry .whl and .dev/libexl2_kernels.so.gz). Session 10's
# three GPU test runs each hit their time limit before the end of their lists (nothing failed in what ran), so
# first the tests of that session's code, verbose, with the slowest listed (to plan the next runs):
#  1. fold_down_order on the GPU (bit-identical MLP, in-order gated GEMV), the pre-gathering norm (every width,
#     K = 576 .. 8192, three parts, the model forward with the norm-fused GEMV capped at two rows), the chain,
#     batch invariance (decode of several sequences: the pre-gathering norm), fp16 pages through the one-pass
#     attention (its default now);
#  2. the rest of the GPU tests that need no SmolLM2, with what time is left.
export EXL2_CARRIED_LIBRARY=1
source scripts/device/common.sh
results_dir
trap '[ -d "$R" ] && pack_results s1' EXIT
T0=$(date +%s)
left() { echo $(( ${1} - ($(date +%s) - T0) )); }
vtests() {  # name seconds [pytest arguments...]: verbose, slowest 25, the outcome counts on stdout
  local name=$1 secs=$2; shift 2
  timeout "$secs" python3 -m pytest "$@" -m cuda -p no:cacheprovider -n 6 -v --durations=25 > "$R/$name.txt" 2>&1
  grep -cE " PASSED " "$R/$name.txt" | sed "s/^/$name passed: /"
  grep -E " FAILED | ERROR |^FAILED|^ERROR|[0-9]+ (passed|failed)" "$R/$name.txt" | tail -8
}
vtests session10 280 tests/kernels/test_fold_down_order_cuda.py tests/kernels/test_gemv_norm.py \
  tests/serve/test_batch_invariance.py tests/kernels/test_gemv_chain.py tests/kernels/test_paged_attention.py \
  -k "fold or norm or invarian or chain or online2"
echo "session10 tests $(( $(date +%s) - T0 )) s"
vtests rest "$(left 560)" $CUDA_TESTS_NO_SMOLLM2 -k "not (fold or norm or invarian or chain or online2)"
echo "total $(( $(date +%s) - T0 )) s"
