#!/usr/bin/env bash
# Device call BD15 (session 37; carry .whl and .dev/libexl2_kernels.so.gz; ~100 s). The GEMV plan cache is now
# keyed by GEMV_SPLITS and GEMV_WAVES too (host side; production settings are constants, so the same plans): the
# GEMV GPU tests with the chain's 8B-layer tests, and the split-plan unit tests.
export EXL2_CARRIED_LIBRARY=1
source scripts/device/common.sh
begin_call bd15
nvidia-smi --query-gpu=name --format=csv,noheader
gpu_tests gemv 200 -n 8 $GEMV_GPU_TESTS
timeout 120 python3 -m pytest -q -p no:cacheprovider tests/unit/test_gemv_split_plan.py 2>&1 | tail -2
echo "total $(( $(date +%s) - T0 )) s"
