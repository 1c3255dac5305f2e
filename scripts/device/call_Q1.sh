#!/usr/bin/env bash
# Device call Q1 (session 10; carry .whl and .dev/libexl2_kernels.so.gz): the environment-only A/Bs that P1 and
# P2 prepared, in order of what they decide, each skipped once the call nears its limit:
#  1. verify costs with the norm fused over 1 and 3 passes (issue 7: k = 4 verify <= 1.15x a decode step);
#  2. the 8B decode step at 1k with GEMV blocks planned 2 / 4 / 6 per SM (the second-slot slowdown);
#  3. the attention variants end to end at 32k (issue 6);
#  4. the decode step with each GEMV stage skipped (EXL2_GEMV_PROBE; outputs wrong, timings valid).
export EXL2_CARRIED_LIBRARY=1
source scripts/device/common.sh
results_dir
trap '[ -d "$R" ] && pack_results q1' EXIT
T0=$(date +%s)
left() { echo $(( ${1} - ($(date +%s) - T0) )); }  # seconds left of a budget of $1
for passes in 1 3; do spec_costs "passes$passes" EXL2_BACKEND_FUSED_NORM_PASSES=$passes; done
echo "spec $(( $(date +%s) - T0 )) s"
for per_sm in 2 4 6; do decode_step_1k "bps$per_sm" nochain EXL2_BACKEND_GEMV_BLOCKS_PER_SM=$per_sm; done
echo "balance $(( $(date +%s) - T0 )) s"
bench32k() { local name=$1; shift; bench_8b "attn_$name" 90 32768 fp16,q8,q4 "$@"; }  # name, then ENV=VALUE...
for v in "default" "online2 EXL2_BACKEND_ATTN_MMA_ONLINE=2 EXL2_BACKEND_ATTN_FP16_MMA=1" \
         "online1 EXL2_BACKEND_ATTN_MMA_ONLINE=1 EXL2_BACKEND_ATTN_FP16_MMA=1"; do
  [ "$(left 450)" -gt 60 ] && bench32k $v
done
echo "attention $(( $(date +%s) - T0 )) s"
for probe in 0 4 1; do
  [ "$(left 560)" -gt 45 ] || break
  decode_step_1k "probe$probe" nochain EXL2_GEMV_PROBE=$probe
  grep -A3 "critical path" "$R/prof_probe$probe.txt" | grep gemv_tma | head -1
done
echo "total $(( $(date +%s) - T0 )) s"
