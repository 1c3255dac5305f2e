#!/usr/bin/env bash
# Device call BF3 (session 40; carry .whl and .dev; ~5 min): the pre-gathering norm with every xmap entry loaded
# before its PDL wait (a verify step runs it twice per layer; the second group of entries was an L2 round trip
# after the norm), library P, against the lazy-max library of BF2 (L, .dev/lib_lazy.so.gz): the GEMV and norm GPU
# tests, then spec_bench's step costs P / L / P with a 32 KB GEMV ring (session 39's BE7, never run), interleaved
# twice.
export EXL2_CARRIED_LIBRARY=1
source scripts/device/common.sh
begin_call bf3
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
gpu_tests_verbose gemv_tests 150 -n 12 $GEMV_GPU_TESTS tests/kernels/test_gemv_repeat_identical.py
echo "tests $(( $(date +%s) - T0 )) s"
use_libraries L=.dev/lib_lazy.so.gz
cp /tmp/libD.so /tmp/libP.so
for round in 1 2; do
  for v in P L P32; do
    cp "/tmp/lib${v:0:1}.so" "$LIB"
    if [ "$v" = P32 ]; then fits 60 "spec $v$round" && spec_costs "$v$round" EXL2_GEMV_RING_KB=32
    else fits 60 "spec $v$round" && spec_costs "$v$round"; fi
  done
done
cp /tmp/libP.so "$LIB"
echo "total $(( $(date +%s) - T0 )) s"
