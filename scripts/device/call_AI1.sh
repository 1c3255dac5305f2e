#!/usr/bin/env bash
# Device call AI1 (prepared in session 19, not yet run; carry .whl and .dev/libexl2_kernels.so.gz; ~250 s): the
# pytest-benchmark baseline issue 3 asks for. The suite under tests/bench (the GEMV at M = 1 / 5 on both kernels,
# RMSNorm, rope, paged attention over fp16 and quantized pages) saved as run 0001 "h200" into
# $OUT/r/benchmarks, to be committed as docs/measurements/benchmarks; later runs compare against it with
#   python -m pytest tests/bench --benchmark-enable --benchmark-storage=file://docs/measurements/benchmarks \
#     --benchmark-compare=0001 --benchmark-compare-fail=mean:10%
# (pytest-benchmark files runs by machine id, Linux-CPython-3.12-64bit on the device image). Then `bench` at 1k
# and the verify costs if time is left.
export EXL2_CARRIED_LIBRARY=1
source scripts/device/common.sh
begin_call ai1
timeout 240 python3 -m pytest tests/bench -m cuda -p no:cacheprovider -q --benchmark-enable \
  --benchmark-storage="file://$R/benchmarks" --benchmark-save=h200 --benchmark-columns=min,mean,median,stddev,rounds \
  > "$R/bench_suite.txt" 2>&1
stop_test_workers
grep -E "passed|failed|Error" "$R/bench_suite.txt" | tail -4; find "$R/benchmarks" -name "*.json" | head -3
echo "elapsed $(( $(date +%s) - T0 )) s"
if [ "$(left 330)" -gt 80 ]; then bench_8b ai1 "$(left 320)" 1024 fp16; spec_costs ai1; fi
echo "total $(( $(date +%s) - T0 )) s"
