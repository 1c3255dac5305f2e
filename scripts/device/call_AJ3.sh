#!/usr/bin/env bash
# Device call AJ3 (session 21; carry .whl and .dev: libexl2_kernels.so.gz (narrowing reverted) and
# libexl2_kernels_timeline.so.gz; ~550 s). AJ2: narrowed column blocks lost (reverted); one run each of the TMA
# GEMV's ring at 24 / 48 KB (EXL2_GEMV_RING_KB; default 32) gave a decode step of 2.269 / 2.342 ms against ~2.285.
#  1. The ring at 16, 20, 24, 28 and 32 KB, spec_bench interleaved twice (4-bit slots are 8 KB: 16 and 20 KB
#     hold two, 24 and 28 three, 32 four; 3-bit slots 6 KB).
#  2. The decode step's GEMV timeline at 24 and 32 KB: which stage the ring size moves.
#  3. `bench` of the 8B at 1k and 32k, fp16 / q8 / q4, at 24 KB.
#  4. The GEMV GPU tests and the batch-invariance tests at 24 KB, in what time is left.
export EXL2_CARRIED_LIBRARY=1
source scripts/device/common.sh
begin_call aj3
use_libraries T=.dev/libexl2_kernels_timeline.so.gz
for round in 1 2; do
  for kb in 16 20 24 28 32; do spec_costs R${kb}_$round EXL2_GEMV_RING_KB=$kb; done
done
cp /tmp/libT.so "$LIB"
for kb in 24 32; do
  EXL2_GEMV_RING_KB=$kb timeout 80 python3 scripts/gemv_timeline.py --workdir /tmp/models \
    --json "$R/timeline_R$kb.json" > "$R/timeline_R$kb.txt" 2>&1
  echo "-- timeline ring $kb KB"; tail -8 "$R/timeline_R$kb.txt"
done
cp /tmp/libD.so "$LIB"
echo "elapsed $(( $(date +%s) - T0 )) s"
bench_8b ring24 130 1024,32768 fp16,q8,q4 EXL2_GEMV_RING_KB=24
echo "elapsed $(( $(date +%s) - T0 )) s"
EXL2_GEMV_RING_KB=24 gpu_tests_verbose gemv "$(left 540)" -n 12 $GEMV_GPU_TESTS tests/serve/test_batch_invariance.py \
  -k "not llama3_8b"
echo "total $(( $(date +%s) - T0 )) s"
