#!/usr/bin/env bash
# Device call BE7 (session 39; carry .whl and .dev; ~3 min): the GEMV ring's size on the H100 with the proxy fence
# (session 38). The 24 KB default was chosen on the H200 before the fence (AJ3 of 2026-12-04: 24 and 28 KB even, 16,
# 20 and 32 KB slower); the fence releases each slot a little later, which a deeper ring could hide. spec_bench's 8B
# step costs with EXL2_GEMV_RING_KB 24 (default), 28 and 32, interleaved twice. Prepared in session 39, not run (too
# little device time was left to start a machine).
export EXL2_CARRIED_LIBRARY=1
source scripts/device/common.sh
begin_call be7
nvidia-smi --query-gpu=name --format=csv,noheader
interleaved_spec_costs ring24 ring28=EXL2_GEMV_RING_KB=28 ring32=EXL2_GEMV_RING_KB=32
echo "total $(( $(date +%s) - T0 )) s"
