#!/usr/bin/env bash
# Device call AM1 (prepared in session 23, not yet run; ~540 s). Carry .whl and .dev with two libraries built from
# the commit that runs:
#     bash scripts/build_variant.sh "" .dev/libexl2_kernels.so.gz          # the default library
#     bash scripts/build_variant.sh EXL2_GEMV_GROUP32_FAST .dev/libexl2_kernels_g32.so.gz
# Whether the group-32 GEMV path becomes the default (exl2_gemv.cuh gv_unit_group32: a chunk of two whole 32-row
# groups sums each group from a zero mma C operand and scales it into the totals, no accumulator clearing, no
# group-end branch; bit-identical by construction). AL1: decode step 2.250 / 2.245 ms against 2.255 / 2.251 (-0.27%),
# and 149 of its GEMV tests passed before that call's 70 s limit.
#  1. The whole GEMV GPU suite on the group-32 library (396 tests, ~300 s on 12 workers in AL1).
#  2. spec_bench default (D) / group-32 (G) interleaved twice; bench at 1k and 32k (fp16) for each.
export EXL2_CARRIED_LIBRARY=1
source scripts/device/common.sh
begin_call am1
use_libraries G=.dev/libexl2_kernels_g32.so.gz
cp /tmp/libG.so "$LIB"
gpu_tests_verbose g32 330 -n 12 $GEMV_GPU_TESTS -k "not llama3_8b"
echo "elapsed $(( $(date +%s) - T0 )) s"
for round in 1 2; do  # each pair only while its two 60 s timeouts fit (common.sh fits)
  fits 130 "spec pair $round" || break
  cp /tmp/libD.so "$LIB"; spec_costs D$round
  cp /tmp/libG.so "$LIB"; spec_costs G$round
done
[ "$(left 440)" -gt 30 ] && { cp /tmp/libD.so "$LIB"; bench_8b D "$(left 440)" 1024,32768 fp16; }
[ "$(left 560)" -gt 30 ] && { cp /tmp/libG.so "$LIB"; bench_8b G "$(left 560)" 1024,32768 fp16; }
cp /tmp/libD.so "$LIB"
echo "total $(( $(date +%s) - T0 )) s"
