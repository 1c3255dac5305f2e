#!/usr/bin/env bash
# Device call AW2 (session 32; carry .whl and .dev/libexl2_kernels.so.gz, C ABI 12; ~150 s): the top-k kernel with
# AW1's parameter aliasing fixed, and its rows without a top-k (top-p / min-p over the whole row,
# sample_nucleus.cuh), now on by default. The sampler kernel tests (filtered rows through the kernel and through
# the torch path), the sampled-lookahead and sampled-engine tests; filter_cost (one 128k row: peaked, spread and
# flat rows through the kernel against the torch path); sampled_bench on the random 8B, default and with
# EXL2_BACKEND_FUSED_TOP_K=0.
export EXL2_CARRIED_LIBRARY=1
source scripts/device/common.sh
begin_call aw2
nvidia-smi --query-gpu=name --format=csv,noheader
sampler_checks
echo "total $(( $(date +%s) - T0 )) s"
