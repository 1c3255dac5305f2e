#!/usr/bin/env bash
# Device call Y1 (prepared in session 14, not yet run; carry .whl, .dev/libexl2_kernels.so.gz and
# .dev/libexl2_kernels_pairs.so.gz): the measurement build EXL2_GEMV_CHUNK_PAIRS (the TMA GEMV's chunk loop takes two
# chunks per iteration at M <= 8 and up to 4-bit weights: both slots waited for and read, then both decoded) against
# the default. X2's ncu of the 8B's 4-bit gate/up: 58% of the stall samples in the chunk loop, 3.5 warps per
# scheduler issuing every 7.4 cycles, the DRAM at 44%.
#  1. the 8B decode step at 1k, default / pairs interleaved twice, GEMV time by role and bit widths;
#  2. bench_gemm --m1 (the widths table) with each library;
#  3. the GEMV GPU tests with the pairs build (it becomes the code if it wins).
export EXL2_CARRIED_LIBRARY=1
source scripts/device/common.sh
begin_call y1
LIB=exl2_backend/_lib/libexl2_kernels.so
cp "$LIB" /tmp/libD.so && gunzip -c .dev/libexl2_kernels_pairs.so.gz > /tmp/libP.so
interleaved_steps D1 P1 D2 P2
for v in D P; do
  cp "/tmp/lib$v.so" "$LIB"
  timeout 60 python3 scripts/bench_gemm.py --m1 > "$R/m1_$v.txt" 2>&1
  echo "== m1 $v"; grep -E "4096x14336|14336x4096|4096x4096" "$R/m1_$v.txt" | head -12 | cut -c1-150
done
cp /tmp/libP.so "$LIB"
echo "elapsed $(( $(date +%s) - T0 )) s"
gpu_tests_verbose kern "$(left 585)" -n 14 $GEMV_GPU_TESTS -k "not llama3_8b"
cp /tmp/libD.so "$LIB"
echo "total $(( $(date +%s) - T0 )) s"
