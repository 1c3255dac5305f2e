#!/usr/bin/env bash
# Device call U5 (session 12; carry .whl and .dev/libexl2_kernels.so.gz): a floor of three ring slots
# (EXL2_GEMV_MIN_STAGES=3) against the default two. U2's floor of four made the 6-bit head 134 -> 170 us: its
# 48 KB ring with 66 KB of staged scales (one split of 64 chunks) left room for one block per SM. Three slots of
# 12 KB keep two. The 8B decode step at 1k (profile_decode nochain), interleaved twice.
export EXL2_CARRIED_LIBRARY=1
source scripts/device/common.sh
begin_call u5
for v in "d1" "s1 EXL2_GEMV_MIN_STAGES=3" "d2" "s2 EXL2_GEMV_MIN_STAGES=3"; do
  set -- $v; name=$1; shift
  decode_step_1k "$name" nochain "$@"
  grep -A7 "GEMVs by role" "$R/prof_$name.txt" | tail -6
done
echo "total $(( $(date +%s) - T0 )) s"
