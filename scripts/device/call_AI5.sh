#!/usr/bin/env bash
# Device call AI5 (session 20; carry .whl and .dev/libexl2_kernels.so.gz, the library of AI3/AI4; ~90 s): `bench`'s
# prefill figure is now the median of three 2k prefills of fresh ids (one timed prefill moved by a third between
# processes); the 8B at 1k with fp16, q8 and q4 caches in one process shows the three runs of each.
export EXL2_CARRIED_LIBRARY=1
source scripts/device/common.sh
begin_call ai5
bench_8b prefill3 150 1024 fp16,q8,q4
grep -E "^prefill" "$R/bench_prefill3.txt"
echo "total $(( $(date +%s) - T0 )) s"
