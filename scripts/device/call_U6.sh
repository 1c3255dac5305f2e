#!/usr/bin/env bash
# Device call U6 (session 12; carry .whl and .dev/libexl2_kernels.so.gz): one `with_bits` shared by the TMA GEMV
# and the chain kernel (a move, no change in the code generated): the GEMV and chain GPU tests, and the 8B decode
# step at 1k once.
export EXL2_CARRIED_LIBRARY=1
source scripts/device/common.sh
begin_call u6
decode_step_1k final nochain
gpu_tests kern "$(left 330)" -n 8 tests/kernels/test_exl2_gemm.py tests/kernels/test_gemv_chain.py \
  -k "not llama3_8b" tests/kernels/test_gemv_rope_kv.py tests/unit/test_gemv_split_plan.py
echo "total $(( $(date +%s) - T0 )) s"
