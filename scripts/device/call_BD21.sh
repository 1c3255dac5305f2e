#!/usr/bin/env bash
# Device call BD21 (session 38; carry .whl and .dev; ~4 min). BD20: the gated down GEMV at M = 2 varies in a quarter
# of its repeats (three quarters after a fill kernel), both rows together, every column block in turn, never NaN
# (no unwritten output, no unwritten partial summed). race_probe.py on it under the launch settings that move the
# producer's timing (scales after the ring fill, deeper ring, larger ring, fewer blocks, other splits), with the
# differing warp tiles of the first repeats and the distance of each result from the fp32 reference.
export EXL2_CARRIED_LIBRARY=1
source scripts/device/common.sh
begin_call bd21
nvidia-smi --query-gpu=name --format=csv,noheader
race_probe default 3000 "--no-nan --only down_gated_m2,down_gated_m1,gate_up_norm_m2"
race_probe scales_after 3000 "--no-nan --only down_gated_m2" EXL2_GEMV_SCALES_FIRST=0
race_probe min_stages4 3000 "--no-nan --only down_gated_m2" EXL2_GEMV_MIN_STAGES=4
race_probe ring48 3000 "--no-nan --only down_gated_m2" EXL2_GEMV_RING_KB=48
race_probe blocks1 3000 "--no-nan --only down_gated_m2" EXL2_BACKEND_GEMV_BLOCKS_PER_SM=1
race_probe proportional 3000 "--no-nan --only down_gated_m2" EXL2_BACKEND_GEMV_SPLITS=proportional
race_probe prewait1 3000 "--no-nan --only down_gated_m2" EXL2_GEMV_PREWAIT_SLOTS=1
race_probe no_pdl 3000 "--no-nan --only down_gated_m2" EXL2_BACKEND_PDL=0
echo "total $(( $(date +%s) - T0 )) s"
