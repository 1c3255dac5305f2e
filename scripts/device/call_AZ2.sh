#!/usr/bin/env bash
# Device call AZ2 (session 34; carry .whl and .dev/libexl2_kernels.so.gz; ~60 s): the least a short call can check
# of the session's library. The norm handoff's kernel tests (tests/kernels/test_gemv_handoff.py), and the default
# GEMV path through the refactored split-K reduce (gv_sum_partials_vec4) and the 48-field descriptors (C ABI 14):
# the GEMV against the reference for every width, the vec4 reduction's bit-identity, the fused norm.
export EXL2_CARRIED_LIBRARY=1
source scripts/device/common.sh
begin_call az2
nvidia-smi --query-gpu=name --format=csv,noheader
gpu_tests handoff "${AZ2_SECONDS:-60}" -n 12 tests/kernels/test_gemv_handoff.py tests/kernels/test_exl2_gemm.py \
  tests/kernels/test_gemv_norm.py -k "handoff or gemv_each_width or vec4 or token_tiles or norm_fused_gemv_equals"
echo "total $(( $(date +%s) - T0 )) s"
