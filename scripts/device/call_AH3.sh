#!/usr/bin/env bash
# Device call AH3 (session 19; carry .whl and .dev/libexl2_kernels.so.gz; ~350 s): the closing figures of today's
# code (the session-17 kernels; AH2's norm tail is reverted) in one run: `bench` of the 8B at 1k and 32k with fp16,
# q8 and q4 caches, the verify / decode step costs, and ExLlamaV2 0.3.2 beside ours on the same 8B directory at 1k
# (its JIT build runs during the bench).
export EXL2_CARRIED_LIBRARY=1
source scripts/device/common.sh
begin_call ah3
start_exllamav2_jit
final_figures 370
echo "total $(( $(date +%s) - T0 )) s"
