#!/usr/bin/env bash
# Device call AW3 (session 32; carry .whl and .dev/libexl2_kernels.so.gz, C ABI 12; ~150 s): after AW2 (H100: every
# kernel test passed but the lookahead's logprobs test; rows without top-k past the best 64 cost more than the
# torch path, 424 / 1328 us for spread / flat rows against ~400): the histogram merge with 16 loads in flight per
# thread, a crowded bin narrowed by 8-bit digits summed without atomics. The lookahead debug first
# (scripts/device/debug_nucleus_lookahead.py), then the sampling tests, filter_cost and sampled_bench as AW2.
export EXL2_CARRIED_LIBRARY=1
source scripts/device/common.sh
begin_call aw3
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 90 python3 scripts/device/debug_nucleus_lookahead.py > "$R/debug.txt" 2>&1; tail -30 "$R/debug.txt" | cut -c1-400
sampler_checks
echo "total $(( $(date +%s) - T0 )) s"
