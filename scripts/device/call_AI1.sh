#!/usr/bin/env bash
# Device call AI1 (prepared in session 19, run in session 20; carry .whl, .dev/libexl2_kernels.so.gz and
# .dev/libexl2_kernels_spec.so.gz; ~420 s).
#  1. Why kernels compiled per feature set made the decode step slower (AH1: 2.30 -> 2.33 ms). The measurement
#     library (-DEXL2_GEMV_SPECIALIZED) now also has EXL2_GEMV_SPECIALIZED=2: the kFAll kernel's code unchanged,
#     as a separate function per decode role (o, down, gate/up and head, q/k/v). If those copies lose like the
#     feature sets (F), launching a different function each time costs (instruction-cache misses at a launch's
#     start); if they match the default (D), the narrower code itself was slower. Interleaved twice.
#  2. The pytest-benchmark baseline issue 3 asks for: tests/bench saved as run 0001 "h200" into $OUT/r/benchmarks,
#     to be committed as docs/measurements/benchmarks; later runs compare against it with
#       python -m pytest tests/bench --benchmark-enable --benchmark-storage=file://docs/measurements/benchmarks \
#         --benchmark-compare=0001 --benchmark-compare-fail=median:10%  (as the README says since AI4)
#     (pytest-benchmark files runs by machine id, Linux-CPython-3.12-64bit on the device image).
export EXL2_CARRIED_LIBRARY=1
source scripts/device/common.sh
begin_call ai1
use_libraries S=.dev/libexl2_kernels_spec.so.gz
for round in 1 2; do
  cp /tmp/libD.so "$LIB"; spec_costs D$round
  cp /tmp/libS.so "$LIB"; spec_costs C$round EXL2_GEMV_SPECIALIZED=2
  spec_costs F$round EXL2_GEMV_SPECIALIZED=1
done
cp /tmp/libD.so "$LIB"
echo "elapsed $(( $(date +%s) - T0 )) s"
timeout 240 python3 -m pytest tests/bench -m cuda -p no:cacheprovider -q --benchmark-enable \
  --benchmark-storage="file://$R/benchmarks" --benchmark-save=h200 --benchmark-columns=min,mean,median,stddev,rounds \
  > "$R/bench_suite.txt" 2>&1
stop_test_workers
grep -E "passed|failed|Error" "$R/bench_suite.txt" | tail -4; find "$R/benchmarks" -name "*.json" | head -3
echo "total $(( $(date +%s) - T0 )) s"
