#!/usr/bin/env bash
# Device call Z2 (session 15; carry .whl and .dev/libexl2_kernels.so.gz): the session's final library (Y1's lean
# flush is the code; Z1's zero-point fold lost and stays a measurement build). The 8B decode step at 1k with its
# critical path, then `bench` at 1k and 32k (fp16 / q8 / q4), verify costs and ExLlamaV2 at 1k beside ours.
export EXL2_CARRIED_LIBRARY=1
source scripts/device/common.sh
begin_call z2
start_exllamav2_jit
decode_step_1k final nochain
grep -A16 "critical path" "$R/prof_final.txt" | head -18 | cut -c1-120
echo "elapsed $(( $(date +%s) - T0 )) s"
final_figures 430
echo "total $(( $(date +%s) - T0 )) s"
