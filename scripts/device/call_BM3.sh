#!/usr/bin/env bash
# Device call BM3 (session 49; carry .whl and .dev; BM3_LIMIT seconds (400)): ExLlamaV2 0.3.2 beside ours in one run
# on whatever card comes (the last same-run ratio is session 46's BL3 on an H100), after the closing `bench`.
#  1. ExLlamaV2's JIT build in the background (~2.5 min);
#  2. `bench` 8B 4.0 bpw at 1k and 32k, fp16 / q8 / q4 caches (writes the random 8B directory both read);
#  3. exllamav2_compare.py: its decode at 1k and 2k prefill against ours on the same directory.
export EXL2_CARRIED_LIBRARY=1
source scripts/device/common.sh
begin_card_call bm3 "${BM3_LIMIT:-400}"
[ "$h200" = 1 ] || start_exllamav2_jit
fits 140 "bench" "$L" && bench_8b final 130 1024,32768 fp16,q8,q4
echo "bench $(( $(date +%s) - T0 )) s"
[ "$(left "$L")" -gt 90 ] && exllamav2_vs_ours "$(left "$L")"
echo "total $(( $(date +%s) - T0 )) s"
