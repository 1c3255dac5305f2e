#!/usr/bin/env bash
# Device call U3 (session 12; carry .whl, .dev/libexl2_kernels.so.gz and .dev/libexl2_kernels_A.so.gz): the TMA
# GEMV compiled with only its producer and chunk loop per bit width (777 -> 155 KB of SASS for one token tile)
# against the same library with the old exl2_gemv_tma.cu (A: every path inside the switch on the width).
#  1. the 8B decode step at 1k (profile_decode nochain), A / B interleaved twice;
#  2. the GPU tests of the GEMV kernels with the new library.
export EXL2_CARRIED_LIBRARY=1
source scripts/device/common.sh
begin_call u3
cp "$LIB" /tmp/libB.so && gunzip -c .dev/libexl2_kernels_A.so.gz > /tmp/libA.so
for v in A1 B1 A2 B2; do
  cp "/tmp/lib${v:0:1}.so" "$LIB"
  decode_step_1k "$v" nochain
  grep -A7 "GEMVs by role" "$R/prof_$v.txt" | tail -5
done
cp /tmp/libB.so "$LIB"
echo "steps $(( $(date +%s) - T0 )) s"
gpu_tests kern "$(left 540)" -n 6 tests/kernels/test_exl2_gemm.py tests/kernels/test_gemv_norm.py \
  tests/kernels/test_gemv_rope_kv.py tests/kernels/test_fold_down_order_cuda.py tests/kernels/test_gemv_chain.py -k "not llama3_8b" \
  tests/unit/test_gemv_split_plan.py
echo "total $(( $(date +%s) - T0 )) s"
