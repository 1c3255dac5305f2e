#!/usr/bin/env bash
# Device call AI2 (session 20; carry .whl and .dev/libexl2_kernels.so.gz; ~560 s): the pytest-benchmark baseline
# issue 3 asks for, now with end-to-end decode and prefill (tests/bench/test_bench_end_to_end.py: the 1B and 8B
# shapes at 4.0 bpw), saved as run 0001 "h200" into $OUT/r/benchmarks (committed as docs/measurements/benchmarks);
# then the README's compare command against it in the same call (run-to-run spread, and the command checked); then
# the GPU tests that need no SmolLM2.
export EXL2_CARRIED_LIBRARY=1
source scripts/device/common.sh
begin_call ai2
bench_suite suite_save 170 --benchmark-save=h200
find "$R/benchmarks" -name "*.json"
bench_suite suite_compare 170 --benchmark-compare=0001 --benchmark-compare-fail=mean:10%
gpu_tests_verbose gpu_tests "$(left 560)" -n 12 $CUDA_TESTS_NO_SMOLLM2
echo "total $(( $(date +%s) - T0 )) s"
