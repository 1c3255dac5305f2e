#!/usr/bin/env bash
# Device call AA2 (prepared in session 15, not yet run; carry .whl and .dev/libexl2_kernels.so.gz): a session's
# closing figures with issue 6's ratio against ExLlamaV2 at 32k, not measured since session 11 (call T1: ExLlamaV2
# 29.6 tok/s with an fp16 cache, 26.4 with q4): `bench` at 1k and 32k (fp16 / q8 / q4), verify costs, then
# ExLlamaV2 and ours at 32k, fp16 and q4 caches, on the random 8B directory the bench wrote.
export EXL2_CARRIED_LIBRARY=1
source scripts/device/common.sh
begin_call aa2
start_exllamav2_jit
final_figures 570 --context 32768 --cache-types fp16,q4 --decode-tokens 64
echo "total $(( $(date +%s) - T0 )) s"
