#!/usr/bin/env bash
# Device call AW4 (session 32; carry .whl and .dev/libexl2_kernels.so.gz, C ABI 13; ~150 s): after AW3 (H100: all 110
# tests passed, the lookahead debug found eager and lookahead equal; spread rows 393 us against the torch path's
# 445, flat rows 1,404 against 453: the single CTA's passes over the row): the fallback reads only the boundary
# bins' tokens, from the chunks' sorted keys. The same checks as AW3.
export EXL2_CARRIED_LIBRARY=1
source scripts/device/common.sh
begin_call aw4
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 90 python3 scripts/device/debug_nucleus_lookahead.py > "$R/debug.txt" 2>&1; tail -30 "$R/debug.txt" | cut -c1-400
sampler_checks --profile
echo "total $(( $(date +%s) - T0 )) s"
