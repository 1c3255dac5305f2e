#!/usr/bin/env bash
# Device call AI3 (session 20; carry .whl and .dev/libexl2_kernels.so.gz; ~560 s). AI1 found the kFAll GEMV code
# as one function copy per decode role +99 us on the 8B decode step (the instruction cache), the narrower per-role
# feature sets only +33 us: narrower code pays once the function stays the same. The library now runs every
# launch without cluster split-K or timing probes on one lean kernel (kFLean: those two paths compiled out).
#  1. The GEMV GPU tests on the lean kernel.
#  2. Lean (L, the default) against kFAll (A, EXL2_GEMV_LEAN=0), spec_bench interleaved twice.
#  3. `bench` of the 8B at 1k and 32k with fp16, q8 and q4 caches (the closing figures of this library).
#  4. The pytest-benchmark baseline of this library (tests/bench as run 0001 "h200" into $OUT/r/benchmarks; its
#     rounds are now CUDA-graph replays of ~2 ms, AI2's eager rounds differed by up to 50% between two runs), then
#     the README's compare command against it.
#  5. The GPU tests that need no SmolLM2, in what time is left.
export EXL2_CARRIED_LIBRARY=1
source scripts/device/common.sh
begin_call ai3
gpu_tests_verbose gemv 150 -n 12 $GEMV_GPU_TESTS tests/serve/test_batch_invariance.py -k "not llama3_8b"
for round in 1 2; do
  spec_costs L$round
  spec_costs A$round EXL2_GEMV_LEAN=0
done
echo "elapsed $(( $(date +%s) - T0 )) s"
bench_8b final 130 1024,32768 fp16,q8,q4
echo "elapsed $(( $(date +%s) - T0 )) s"
bench_suite suite_save 110 --benchmark-save=h200
bench_suite suite_compare 110 --benchmark-compare=0001 --benchmark-compare-fail=mean:10%
gpu_tests_verbose gpu_tests "$(left 570)" -n 12 $CUDA_TESTS_NO_SMOLLM2 --deselect tests/kernels/test_exl2_gemm.py
echo "total $(( $(date +%s) - T0 )) s"
