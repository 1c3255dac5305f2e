#!/usr/bin/env bash
# Device call BL7 (session 48; ~5 min on an H100, whose host wrote the random 70B in 230 s): `bench` of the 1B and
# 70B shapes at 4.0 bpw, 1k context, fp16 cache (issue 3 reports them beside the 8B).
export EXL2_CARRIED_LIBRARY=1
source scripts/device/common.sh
begin_call bl7
write_70b_background
timeout 120 python3 -m exl2_backend.cli.main bench --shape llama3-1b --bpw 4.0 --model-out /tmp/models/llama3-1b \
  --contexts 1024 --cache-type fp16 --json "$R/bench_1b.json" > "$R/bench_1b.txt" 2>&1
echo "== 1B"; grep -E "^│ +[0-9]+ │|bandwidth" "$R/bench_1b.txt" | cut -c1-200
wait $W70; tail -1 "$R/write_70b.txt"
timeout 200 python3 -m exl2_backend.cli.main bench /tmp/models/llama3-70b --contexts 1024 --cache-type fp16 \
  --json "$R/bench_70b.json" > "$R/bench_70b.txt" 2>&1
echo "== 70B"; grep -E "^│ +[0-9]+ │|bandwidth|prefill" "$R/bench_70b.txt" | cut -c1-200
echo "total $(( $(date +%s) - T0 )) s"
