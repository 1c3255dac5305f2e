#!/usr/bin/env bash
# Device call BD23 (session 38; carry .whl and .dev with lib_old.so.gz, the library before the fix; ~7 min). BD22:
# a proxy fence before the ring slot's release (or a release after the chunk's arithmetic) removed every varying
# result. The library with the fence: race_probe.py again, the GEMV GPU tests with the new repeat test (8 workers, as
# the runs that caught the chain mismatches), and the 8B step costs before / after the fix, interleaved twice.
export EXL2_CARRIED_LIBRARY=1
source scripts/device/common.sh
begin_call bd23
nvidia-smi --query-gpu=name --format=csv,noheader
use_libraries O=.dev/lib_old.so.gz
race_probe probe_fixed 3000 "--no-nan --only down_gated_m2,gate_up_norm_m1,gate_up_norm_m2"
gpu_tests_verbose gemv_tests 200 -n 8 $GEMV_GPU_TESTS tests/kernels/test_gemv_repeat_identical.py
for round in 1 2; do
  cp /tmp/libO.so "$LIB"; fits 70 "spec old $round" && spec_costs "old$round"
  cp /tmp/libD.so "$LIB"; fits 70 "spec fixed $round" && spec_costs "fixed$round"
done
cp /tmp/libD.so "$LIB"
echo "total $(( $(date +%s) - T0 )) s"
