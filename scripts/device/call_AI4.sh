#!/usr/bin/env bash
# Device call AI4 (session 20; carry .whl and .dev/libexl2_kernels.so.gz, the library of AI3 (lean GEMV kernel);
# ~150 s): the pytest-benchmark baseline of the final suite (GraphRounds calibrated on >= 32 launches, 8 prefill
# rounds of fresh ids, the engine step without an extra sync) saved as run 0001 "h200" into $OUT/r/benchmarks
# (committed as docs/measurements/benchmarks), then the README's compare command against it.
export EXL2_CARRIED_LIBRARY=1
source scripts/device/common.sh
begin_call ai4
bench_suite suite_save 110 --benchmark-save=h200
bench_suite suite_compare 110 --benchmark-compare=0001 --benchmark-compare-fail=median:10%
echo "total $(( $(date +%s) - T0 )) s"
