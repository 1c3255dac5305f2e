#!/usr/bin/env bash
# Device call W1 (prepared in session 13, not yet run; carry .whl and .dev/libexl2_kernels.so.gz): the session-13
# library (span splits where they pay) measured cleanly.
#  1. `bench` at 1k and 32k first, before any test run (V3's prefill, 18.2k tok/s against 29.5k in U4, ran beside
#     test workers a timeout had orphaned), verify costs, ExLlamaV2 at 1k;
#  2. the GEMV GPU tests to the end (test_gemm_torch_compile included: the dynamo fix has not run on a GPU).
export EXL2_CARRIED_LIBRARY=1
source scripts/device/common.sh
begin_call w1
start_exllamav2_jit
final_figures 330
gpu_tests_verbose kern "$(left 590)" -n 14 $GEMV_GPU_TESTS -k "not llama3_8b"
echo "total $(( $(date +%s) - T0 )) s"
