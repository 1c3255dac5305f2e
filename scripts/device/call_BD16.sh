#!/usr/bin/env bash
# Device call BD16 (session 37; carry .whl and .dev/libexl2_kernels.so.gz; ~90 s). BD15 reproduced the opt-in
# chain's 8B-layer mismatch at M = 2 in the GEMV GPU tests (-n 8). The same run, verbose: which tests ran before it
# in its xdist worker.
export EXL2_CARRIED_LIBRARY=1
source scripts/device/common.sh
begin_call bd16
nvidia-smi --query-gpu=name --format=csv,noheader
gpu_tests_verbose gemv 200 -n 8 $GEMV_GPU_TESTS
W=$(grep -E "^\[gw[0-9]+\] .* FAILED " "$R/gemv.txt" | grep -o "^\[gw[0-9]*\]" | head -1)  # the first failure's worker
echo "worker $W"
[ -n "$W" ] && grep -F "$W" "$R/gemv.txt" | head -400 | tail -60 | cut -c1-150
echo "total $(( $(date +%s) - T0 )) s"
