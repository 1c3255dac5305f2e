#!/usr/bin/env bash
# Device call BD20 (session 38; carry .whl and .dev; ~3 min). BD19: the GEMV launches vary inside one launch (PDL
# off and CUDA_LAUNCH_BLOCKING=1 alike), most in the gated down at M = 2. scripts/device/race_probe.py: which
# column blocks and rows vary, whether NaN-filled partials or NaN left in the output's memory show through, and
# whether the scalar split-K sum or the row gather changes it.
export EXL2_CARRIED_LIBRARY=1
source scripts/device/common.sh
begin_call bd20
nvidia-smi --query-gpu=name --format=csv,noheader
probe() {  # probe TAG ITERS [ENV=VALUE...]
  local tag=$1 iters=$2; shift 2
  env "$@" timeout 150 python3 scripts/device/race_probe.py --iters "$iters" --tag "$tag" ${ONLY:+--only $ONLY} \
    > "$R/$tag.txt" 2> "$R/$tag.err"
  echo "== $tag"; grep -v '^{' "$R/$tag.txt" | cut -c1-330; tail -2 "$R/$tag.err"
}
probe default 4000
ONLY=down_gated_m2,gate_up_norm_m1 probe reduce_scalar 3000 EXL2_GEMV_REDUCE=scalar
ONLY=down_gated_m2,gate_up_norm_m1 probe gather_rows 3000 EXL2_GEMV_GATHER=rows
echo "total $(( $(date +%s) - T0 )) s"
