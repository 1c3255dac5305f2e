#!/usr/bin/env bash
# Device call AO1 (prepared in session 24, reviewed in session 25, not yet run; ~450-570 s). Carry .whl and two
# libraries built from the commit that runs:
#     bash scripts/build_variant.sh "" .dev/libexl2_kernels.so.gz                      # the default library
#     bash scripts/build_variant.sh EXL2_GEMV_DEEP_RING .dev/libexl2_kernels_deep.so.gz
# The deep weight ring (exl2_gemv_tma.cuh tma_stages; the flight count in tma_produce_run): the ring holds
# EXL2_GEMV_DEEP_RING_KB (default 64, capped where two blocks per SM still fit) but at most ring_fill (24 KB: three
# 4-bit slots) of copies are in flight. The first fill then reaches deeper into a block's weights during the PDL
# wait (2.3-4.6 us per launch in AJ1's timeline), while what the block loads through the cache after the wait
# queues behind no more bytes than today; 32 KB rings lost to 24 KB (AJ3) because they raised both at once.
#  1. The split combine in slices of 32 dims (below): its bit-identity test and 32k sweeps.
#  2. The GEMV GPU tests on the deep library (a measurement build; the time limit may cut them).
#  3. spec_bench, default (D) against the deep ring at 48 / 64 / 96 KB (96 is capped per launch), interleaved twice,
#     each case only while 70 s of the call's 570 are left.
export EXL2_CARRIED_LIBRARY=1
source scripts/device/common.sh
begin_call ao1
use_libraries E=.dev/libexl2_kernels_deep.so.gz
# 1. The reduce in slices of 32 dims (EXL2_ATTN_REDUCE_SLICE_MIN; bit-identical: its test first), cheapest, so it
#    comes first: at 32k, each route at its own automatic split (--splits 0: fp16 66 and q8 / q4 49 on the default
#    routes, 132 on the streamed kernel, EXL2_BACKEND_ATTN_STREAM=1).
cp /tmp/libD.so "$LIB"
gpu_tests slices 60 tests/kernels/test_kv_quant_kernels.py -k combine_staged
for v in d s; do
  for sl in 0 32; do
    env EXL2_ATTN_REDUCE_SLICE_MIN=$sl $([ $v = s ] && echo EXL2_BACKEND_ATTN_STREAM=1) timeout 50 \
      python3 scripts/attention_sweep.py --context 32768 --types fp16,q8,q4 --splits 0 \
      > "$R/sweep_${v}_slice$sl.txt" 2>&1
    echo "-- sweep 32k ${v} slice min $sl"; grep -hE "ctas/SM|splits [0-9]|Error" "$R/sweep_${v}_slice$sl.txt"
  done
done
echo "elapsed $(( $(date +%s) - T0 )) s"
# 2. The deep ring's correctness: the TMA GEMV, fused norm / rope and chain tests on its library (the ring's own
#    tests first; the time limit may cut the rest).
cp /tmp/libE.so "$LIB" && gpu_tests deep 120 -n 12 $GEMV_GPU_TESTS -k "not llama3_8b"
echo "elapsed $(( $(date +%s) - T0 )) s"
# 3. spec_bench, default (D) against the deep ring at 48 / 64 / 96 KB, interleaved twice, while time is left.
for round in 1 2; do
  fits 70 "spec D$round" 570 || break
  cp /tmp/libD.so "$LIB" && spec_costs "D$round"
  for kb in 48 64 96; do
    fits 70 "spec E$kb-$round" 570 || break
    cp /tmp/libE.so "$LIB" && spec_costs "E$kb-$round" EXL2_GEMV_DEEP_RING_KB=$kb
  done
done
cp /tmp/libD.so "$LIB"
echo "total $(( $(date +%s) - T0 )) s"
