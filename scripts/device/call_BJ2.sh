#!/usr/bin/env bash
# Not run: session 44 found no machine for it, and call_BK1.sh took over its steps (the GEMV suites, the ncu).
# Device call BJ2 (session 43; carry .whl and .dev; ~200 s). The library is 7e189c0's again (the norm tail lost in
# BJ1 and is gone; csrc/ == 56141b2, C ABI 13). ncu --set full of the 8B decode attention at 32k over q4 and q8
# pages (the default kernels): issue 6's gap (q4 ~1.1, q8 ~1.7 TB/s against fp16's 2.5), stalls by code region
# (scripts/ncu_stalls.py) for the next session's attention work. First the GEMV suites on the rebuilt library.
export EXL2_CARRIED_LIBRARY=1
source scripts/device/common.sh
begin_call bj2
L=${BJ2_LIMIT:-220}
nvidia-smi --query-gpu=name --format=csv,noheader
gpu_tests gemv_suites 60 -n 12 $GEMV_GPU_TESTS -k "not llama3_8b"  # the rebuilt ABI 13 library
ncu_attention_stalls "$L" q4 q8
echo "total $(( $(date +%s) - T0 )) s"
