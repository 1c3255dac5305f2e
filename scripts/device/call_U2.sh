#!/usr/bin/env bash
# Device call U2 (session 12; carry .whl and .dev/libexl2_kernels.so.gz): the TMA GEMV's per-run splits balanced
# by bytes (csrc/quant/exl2_gemv_splits.cuh, EXL2_BACKEND_GEMV_SPLITS / _WAVES) and a floor on ring slots
# (EXL2_GEMV_MIN_STAGES: the 8-bit and 6-bit runs only double-buffer in a 32 KB ring). U1 found gate/up at 31.9 us
# per launch for 61 MB (17.3 us past streaming), the head at 134.5 us for 423 MB.
#  1. the 8B decode step at 1k (profile_decode nochain, GEMV time by role) for each variant;
#  2. the GPU tests of the GEMV kernels under the new default plan.
export EXL2_CARRIED_LIBRARY=1
source scripts/device/common.sh
begin_call u2
for v in "prop EXL2_BACKEND_GEMV_SPLITS=proportional" "bal" "bal_st4 EXL2_GEMV_MIN_STAGES=4" \
         "w15 EXL2_BACKEND_GEMV_WAVES=1.5" "w2 EXL2_BACKEND_GEMV_WAVES=2" \
         "w2_st4 EXL2_BACKEND_GEMV_WAVES=2 EXL2_GEMV_MIN_STAGES=4" \
         "prop_st4 EXL2_BACKEND_GEMV_SPLITS=proportional EXL2_GEMV_MIN_STAGES=4" \
         "bal_r48_st4 EXL2_GEMV_RING_KB=48 EXL2_GEMV_MIN_STAGES=4"; do
  set -- $v; name=$1; shift
  decode_step_1k "$name" nochain "$@"
  grep -A7 "GEMVs by role" "$R/prof_$name.txt" | tail -5
done
echo "steps $(( $(date +%s) - T0 )) s"
gpu_tests kern "$(left 560)" -n 6 tests/kernels/test_exl2_gemm.py tests/kernels/test_gemv_norm.py \
  tests/kernels/test_gemv_rope_kv.py tests/kernels/test_fold_down_order_cuda.py tests/unit/test_gemv_split_plan.py
echo "total $(( $(date +%s) - T0 )) s"
