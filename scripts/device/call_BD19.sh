#!/usr/bin/env bash
# Device call BD19 (session 38; carry .whl and .dev; ~4 min). BD18: the layer's launches one by one vary between
# identical runs alone on the GPU (the chain never did). scripts/device/stage_determinism.py per configuration:
# which stage varies first, and whether launch overlap (PDL) or a race inside one kernel makes it.
export EXL2_CARRIED_LIBRARY=1
source scripts/device/common.sh
begin_call bd19
nvidia-smi --query-gpu=name --format=csv,noheader
run_config() {  # run_config TAG [ENV=VALUE...]; FLAGS: the script's extra flags
  local tag=$1; shift
  env "$@" timeout 110 python3 scripts/device/stage_determinism.py --seconds 4 --tag "$tag" ${FLAGS:-} \
    > "$R/$tag.txt" 2> "$R/$tag.err"
  echo "== $tag"; grep -v '^{' "$R/$tag.txt" | cut -c1-400; tail -2 "$R/$tag.err"
}
run_config default
FLAGS=--sync-stages run_config sync_stages
run_config no_pdl EXL2_BACKEND_PDL=0
run_config launch_blocking CUDA_LAUNCH_BLOCKING=1
echo "total $(( $(date +%s) - T0 )) s"
