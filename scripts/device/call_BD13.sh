#!/usr/bin/env bash
# Device call BD13 (session 37; carry .whl and .dev/libexl2_kernels.so.gz; ~120 s). BD11's one failure (the opt-in
# chain's 8B-layer test at M = 2) did not recur alone (BD12: the chain and the launches bit-identical at M = 1, 2, 8,
# each path deterministic; the test file's 8B tests passed). The same suite again, verbose, so the order of the
# tests in each xdist worker shows what ran before it if it fails again.
export EXL2_CARRIED_LIBRARY=1
source scripts/device/common.sh
begin_call bd13
nvidia-smi --query-gpu=name --format=csv,noheader
gpu_tests_verbose cuda 300 -n 8 $CUDA_TESTS_NO_SMOLLM2
grep -E "FAILED|passed|failed" "$R/cuda.txt" | tail -5
echo "total $(( $(date +%s) - T0 )) s"
