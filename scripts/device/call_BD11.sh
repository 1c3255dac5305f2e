#!/usr/bin/env bash
# Device call BD11 (session 37; carry .whl and .dev/libexl2_kernels.so.gz; ~480 s): the GPU tests that need no
# SmolLM2 on the session's final library (csrc/ = session 35's + the sampler's race_sorted).
export EXL2_CARRIED_LIBRARY=1
source scripts/device/common.sh
begin_call bd11
nvidia-smi --query-gpu=name --format=csv,noheader
gpu_tests cuda 500 -n 8 $CUDA_TESTS_NO_SMOLLM2
echo "total $(( $(date +%s) - T0 )) s"
