#!/usr/bin/env bash
# RAN in session 49 (H100): P LOST (mixed gate/up 31.00 against 28.97 us per launch); the macro is gone (code in git
# at 784030d). docs/performance.md, session 49.
# Device call BM5 (session 49; carry .whl and .dev: libexl2_kernels.so.gz and libexl2_kernels_pen36.so.gz, the
# measurement build `bash scripts/build_variant.sh EXL2_SPAN_RUN_PEN=36 .dev/libexl2_kernels_pen36.so.gz`; ~220 s).
# BM4's GEMV timeline: in the 8 mixed-width gate/up launches (gate 4:0.1 3:0.9, up 4:0.25 3:0.75) the span item that
# covers the 4-bit run and enters the 3-bit one streams ~23 us (up to 26) against ~17 for its column block's other
# item of the same bytes: entering a run (draining and re-arming the ring, staging the run's scales) costs ~6 us, ~11
# chunks. Library P gives every run after the first 36 chunk-bits (12 three-bit chunks) of weight in span_range, so
# the entering item takes ~25 chunks instead of ~31 and the other ~39 instead of ~33 (the pure 4-bit launches are
# unchanged: one run).
#  1. decode / verify step costs (spec_bench, 8B 4.0 bpw at 1k), D (the default library) / P interleaved twice;
#  2. with P: the GEMV GPU tests but the split plan's (whose equal-bytes test P breaks by design);
#  3. with P: the decode step's GEMVs by role and by bit widths (profile_decode), against BM1's.
export EXL2_CARRIED_LIBRARY=1
source scripts/device/common.sh
begin_card_call bm5 "${BM5_LIMIT:-330}"
use_libraries P=.dev/libexl2_kernels_pen36.so.gz
for round in 1 2; do
  cp /tmp/libD.so "$LIB"; spec_costs "D$round"
  cp /tmp/libP.so "$LIB"; spec_costs "P$round"
done
echo "sweep $(( $(date +%s) - T0 )) s"
fits 70 "GEMV tests" "$L" && gpu_tests gemv_p 60 -n 8 $(echo $GEMV_GPU_TESTS | tr ' ' '\n' | grep -v split_plan) \
  -k "not llama3_8b"
if fits 60 "decode step" "$L"; then
  decode_step_1k p nochain
  grep -A9 "by the launch's bit widths" "$R/prof_p.txt" | cut -c1-120
fi
cp /tmp/libD.so "$LIB"
echo "total $(( $(date +%s) - T0 )) s"
