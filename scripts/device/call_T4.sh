#!/usr/bin/env bash
# Device call T4 (session 11; carry .whl and .dev/libexl2_kernels.so.gz): where RoPE inside the q/k/v GEMV stops
# paying (T2/T3: +3.5% at 1k, -1.8% at 32k with an fp16 cache): `bench` at 4k, 8k and 16k, on against
# EXL2_BACKEND_ROPE_IN_GEMV=0.
export EXL2_CARRIED_LIBRARY=1
source scripts/device/common.sh
begin_call t4
for v in "on" "off EXL2_BACKEND_ROPE_IN_GEMV=0"; do
  set -- $v; name=$1; shift
  bench_8b "mid_$name" 75 4096,8192,16384 fp16 "$@"
done
echo "total $(( $(date +%s) - T0 )) s"
