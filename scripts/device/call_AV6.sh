#!/usr/bin/env bash
# Device call AV6 (session 31, not yet run: its device time ran out; carry .whl and .dev/libexl2_kernels.so.gz, C ABI
# 11; ~150 s): the top-k sampling kernel (opt-in, EXL2_BACKEND_FUSED_TOP_K=1; its tests switch it on themselves),
# its tests with the sampler kernel's and the sampled-lookahead engine tests, then filter_cost: a top-k token's
# sampling through the kernel against the torch filter path (no 8B needed). If they pass, make it the default and
# run call_AV5.sh (sampled_bench with and without it).
export EXL2_CARRIED_LIBRARY=1
source scripts/device/common.sh
begin_call av6
nvidia-smi --query-gpu=name --format=csv,noheader
gpu_tests_verbose sampling 100 -n 3 --dist loadfile --timeout 90 tests/kernels/test_sampling_kernel.py \
  tests/engine/test_sampled_lookahead_tiny.py
echo "elapsed $(( $(date +%s) - T0 )) s"
timeout 40 python3 scripts/filter_cost.py 128256 2>&1 | tail -12
echo "total $(( $(date +%s) - T0 )) s"
