#!/usr/bin/env bash
# Device call T3 (session 11; carry .whl and .dev/libexl2_kernels.so.gz), the session's final library (RoPE inside
# the q/k/v GEMV by default):
#  1. `bench` at 1k and 32k, fp16 / q8 / q4 caches; fp16 at 32k again with EXL2_BACKEND_ROPE_IN_GEMV=0 and on,
#     interleaved (T2 had 243.6 off against 239.9 on there, one run each);
#  2. verify costs;
#  3. ExLlamaV2 0.3.2 at 1k on the same random 8B directory with ours (issue 3's same-call ratio).
export EXL2_CARRIED_LIBRARY=1
source scripts/device/common.sh
begin_call t3
start_exllamav2_jit
bench_8b final 130 1024,32768 fp16,q8,q4
for v in "off EXL2_BACKEND_ROPE_IN_GEMV=0" "on" "off2 EXL2_BACKEND_ROPE_IN_GEMV=0" "on2"; do
  set -- $v; name=$1; shift
  bench_8b "fp16_32k_$name" 60 32768 fp16 "$@"
done
spec_costs final
echo "steps $(( $(date +%s) - T0 )) s"
if [ "$(left 470)" -gt 90 ]; then
  exllamav2_vs_ours "$(left 470)"
fi
echo "total $(( $(date +%s) - T0 )) s"
