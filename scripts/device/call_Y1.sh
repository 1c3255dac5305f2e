#!/usr/bin/env bash
# Device call Y1 (prepared in session 14, not yet run; carry .whl, .dev/libexl2_kernels.so.gz,
# .dev/libexl2_kernels_pairs.so.gz and .dev/libexl2_kernels_lean.so.gz): two measurement builds of the TMA GEMV's chunk
# loop against the default. X2's ncu of the 8B's 4-bit gate/up: 58% of the stall samples in the chunk loop, 3.5 warps
# per scheduler issuing every 7.4 cycles, the DRAM at 44%.
#   P  EXL2_GEMV_CHUNK_PAIRS: two chunks per iteration at M <= 8 and up to 4-bit (both slots waited for and read,
#      then both decoded);
#   F  EXL2_GEMV_LEAN_FLUSH: the next group's scales read without a branch (an index clamped to the last group),
#      4-bit warp chunk ~9 instructions shorter in SASS (the flush blocks 27 -> 21 and 37 -> 29).
# Both keep the arithmetic (the same values in the same order). The carried builds come from
# `bash scripts/build_variant.sh MACRO .dev/libexl2_kernels_<pairs|lean>.so.gz` after a default sm_90a build. Steps:
#  1. the 8B decode step at 1k, D / P / F interleaved twice, GEMV time by role and bit widths;
#  2. bench_gemm --m1 (the widths table) with each library;
#  3. the GEMV GPU tests with whichever of P and F had the shorter mean step.
export EXL2_CARRIED_LIBRARY=1
source scripts/device/common.sh
begin_call y1
LIB=exl2_backend/_lib/libexl2_kernels.so
cp "$LIB" /tmp/libD.so
gunzip -c .dev/libexl2_kernels_pairs.so.gz > /tmp/libP.so
gunzip -c .dev/libexl2_kernels_lean.so.gz > /tmp/libF.so
interleaved_steps D1 P1 F1 D2 P2 F2
for v in D P F; do
  cp "/tmp/lib$v.so" "$LIB"
  timeout 60 python3 scripts/bench_gemm.py --m1 > "$R/m1_$v.txt" 2>&1
  echo "== m1 $v"; grep -E "4096x14336|14336x4096|4096x4096" "$R/m1_$v.txt" | head -12 | cut -c1-150
done
step_ms() { cat "$R/prof_${1}1.txt" "$R/prof_${1}2.txt" | grep -o "graph step [0-9.]*" | awk '{s += $3} END {print s / NR}'; }
best=$(for v in P F; do echo "$(step_ms $v) $v"; done | sort -n | head -1 | cut -d' ' -f2)
echo "mean steps: D $(step_ms D) P $(step_ms P) F $(step_ms F); tests with $best"
cp "/tmp/lib$best.so" "$LIB"
echo "elapsed $(( $(date +%s) - T0 )) s"
gpu_tests_verbose kern "$(left 585)" -n 14 $GEMV_GPU_TESTS -k "not llama3_8b"
cp /tmp/libD.so "$LIB"
echo "total $(( $(date +%s) - T0 )) s"
