#!/usr/bin/env bash
# Device call BD24 (session 38; carry .whl and .dev; ~4 min): the fixed library (proxy fence before the GEMV ring
# slot's release) through BD19's layer sequence (stage_determinism.py: o -> gate/up -> down -> q/k/v repeated, every
# stage compared with its first run) and the whole GPU suite that needs no SmolLM2 (8 workers).
export EXL2_CARRIED_LIBRARY=1
source scripts/device/common.sh
begin_call bd24
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 110 python3 scripts/device/stage_determinism.py --seconds 4 --tag fixed > "$R/stages_fixed.txt" 2> "$R/stages_fixed.err"
echo "== stages, fixed library"; grep -v '^{' "$R/stages_fixed.txt" | cut -c1-200; tail -2 "$R/stages_fixed.err"
gpu_tests_verbose cuda 330 -n 8 $CUDA_TESTS_NO_SMOLLM2
echo "total $(( $(date +%s) - T0 )) s"
