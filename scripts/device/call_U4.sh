#!/usr/bin/env bash
# Device call U4 (session 12; carry .whl and .dev/libexl2_kernels.so.gz), the session's final library (balanced
# per-run splits, the width-independent GEMV prologue and finish):
#  1. `bench` at 1k and 32k, fp16 / q8 / q4 caches;
#  2. verify costs;
#  3. ExLlamaV2 0.3.2 at 1k on the same random 8B directory with ours (issue 3's same-call ratio).
export EXL2_CARRIED_LIBRARY=1
source scripts/device/common.sh
begin_call u4
start_exllamav2_jit
bench_8b final 130 1024,32768 fp16,q8,q4
spec_costs final
echo "steps $(( $(date +%s) - T0 )) s"
if [ "$(left 470)" -gt 90 ]; then
  exllamav2_vs_ours "$(left 470)"
fi
echo "total $(( $(date +%s) - T0 )) s"
