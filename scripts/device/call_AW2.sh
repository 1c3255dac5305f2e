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
gpu_tests_verbose sampling 150 -n 3 --dist loadfile --timeout 140 tests/kernels/test_sampling_kernel.py \
  tests/engine/test_sampled_lookahead_tiny.py tests/engine/test_sampled_gpu_tiny.py \
  tests/unit/test_filtered_probs_skip.py tests/unit/test_grammar_mask.py
echo "elapsed $(( $(date +%s) - T0 )) s"
timeout 60 python3 scripts/filter_cost.py 128256 > "$R/filter_cost.txt" 2>&1; tail -16 "$R/filter_cost.txt"
fits 60 "bench 1k" && [ ! -d /tmp/models/llama3-8b ] && bench_8b D 60 1024 fp16
fits 70 "sampled bench" && [ -d /tmp/models/llama3-8b ] && { timeout 70 python3 \
  scripts/sampled_bench.py /tmp/models/llama3-8b --tokens 128 --json "$R/sampled_bench.json" \
  > "$R/sampled_bench.txt" 2>&1; echo "== sampled bench, kernel"; tail -13 "$R/sampled_bench.txt"; }
fits 50 "sampled bench torch" && { EXL2_BACKEND_FUSED_TOP_K=0 timeout 50 python3 scripts/sampled_bench.py \
  /tmp/models/llama3-8b --tokens 128 --json "$R/sampled_bench_torch.json" > "$R/sampled_bench_torch.txt" 2>&1
  echo "== torch filter path"; grep -E "topp|nucleus" "$R/sampled_bench_torch.txt"; }
echo "total $(( $(date +%s) - T0 )) s"
