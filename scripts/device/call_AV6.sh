#!/usr/bin/env bash
# Device call AV6 (session 31; carry .whl and .dev/libexl2_kernels.so.gz, C ABI 11; ~150 s): AV5 cut to the device
# time left. The top-k sampling kernel's tests with the sampler kernel's and the sampled-lookahead engine tests,
# then filter_cost: a top-k token's sampling through the kernel against the torch filter path (no 8B needed).
export EXL2_CARRIED_LIBRARY=1
source scripts/device/common.sh
begin_call av6
nvidia-smi --query-gpu=name --format=csv,noheader
gpu_tests_verbose sampling 100 -n 3 --dist loadfile --timeout 90 tests/kernels/test_sampling_kernel.py \
  tests/engine/test_sampled_lookahead_tiny.py
echo "elapsed $(( $(date +%s) - T0 )) s"
timeout 40 python3 scripts/filter_cost.py 128256 2>&1 | tail -12
echo "total $(( $(date +%s) - T0 )) s"
