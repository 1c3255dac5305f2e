#!/usr/bin/env bash
# Device call BD12 (session 37; carry .whl and .dev/libexl2_kernels.so.gz; ~90 s). BD11 ran the GPU tests without
# SmolLM2 on the final library: 2,292 passed and one failed, the opt-in GEMV chain's 8B-layer test at M = 2
# (outputs 1-2 fp16 ulps off the launches one by one). Which output differs, and is either path nondeterministic?
export EXL2_CARRIED_LIBRARY=1 EXL2_GEMV_CHAIN_VERBOSE=8
source scripts/device/common.sh
begin_call bd12
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 120 python3 scripts/device/debug_chain_m2.py 2>&1 | tee "$R/debug_chain_m2.txt" | grep -v '^exl2_gemv_chain: grid'
grep '^exl2_gemv_chain: grid' "$R/debug_chain_m2.txt" | sort | uniq -c
gpu_tests chain 120 tests/kernels/test_gemv_chain.py -k llama3_8b_layer
echo "total $(( $(date +%s) - T0 )) s"
