#!/usr/bin/env bash
# Device call BD20 (session 38; carry .whl and .dev; ~3 min). BD19: the GEMV launches vary inside one launch (PDL
# off and CUDA_LAUNCH_BLOCKING=1 alike), most in the gated down at M = 2. scripts/device/race_probe.py: which
# column blocks and rows vary, whether NaN-filled partials or NaN left in the output's memory show through, and
# whether the scalar split-K sum or the row gather changes it.
export EXL2_CARRIED_LIBRARY=1
source scripts/device/common.sh
begin_call bd20
nvidia-smi --query-gpu=name --format=csv,noheader
race_probe default 4000 ""
race_probe reduce_scalar 3000 "--only down_gated_m2,gate_up_norm_m1" EXL2_GEMV_REDUCE=scalar
race_probe gather_rows 3000 "--only down_gated_m2,gate_up_norm_m1" EXL2_GEMV_GATHER=rows
echo "total $(( $(date +%s) - T0 )) s"
