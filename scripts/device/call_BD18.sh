#!/usr/bin/env bash
# Device call BD18 (session 38; carry .whl and .dev; ~2 min). BD17 ran BD16's failing worker sequence in one process:
# 59 passed, chain and launches bit-identical. The failures came only with 8 xdist workers sharing the GPU, so:
# scripts/device/determinism_under_contention.py alone (control), then 8 copies at once.
export EXL2_CARRIED_LIBRARY=1
source scripts/device/common.sh
begin_call bd18
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 120 python3 scripts/device/determinism_under_contention.py --seconds 15 --tag alone > "$R/alone.json" 2> "$R/alone.err"
tail -3 "$R/alone.err"; cat "$R/alone.json"
for i in 1 2 3 4 5 6 7 8; do
  timeout 200 python3 scripts/device/determinism_under_contention.py --seconds 45 --tag "$i" > "$R/c$i.json" 2> "$R/c$i.err" &
done
wait
for i in 1 2 3 4 5 6 7 8; do tail -2 "$R/c$i.err"; cat "$R/c$i.json"; done
echo "total $(( $(date +%s) - T0 )) s"
