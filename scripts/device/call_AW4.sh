#!/usr/bin/env bash
# Device call AW4 (session 32; carry .whl and .dev/libexl2_kernels.so.gz, C ABI 13; ~150 s): after AW3 (H100: all 110
# tests passed, the lookahead debug found eager and lookahead equal; spread rows 393 us against the torch path's
# 445, flat rows 1,404 against 453: the single CTA's passes over the row): the fallback reads only the boundary
# bins' tokens, from the chunks' sorted keys. The same checks as AW3.
export EXL2_CARRIED_LIBRARY=1
source scripts/device/common.sh
begin_call aw4
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 90 python3 scripts/device/debug_nucleus_lookahead.py > "$R/debug.txt" 2>&1; tail -30 "$R/debug.txt" | cut -c1-400
gpu_tests_verbose sampling 150 -n 3 --dist loadfile --timeout 140 tests/kernels/test_sampling_kernel.py \
  tests/engine/test_sampled_lookahead_tiny.py tests/engine/test_sampled_gpu_tiny.py \
  tests/unit/test_filtered_probs_skip.py tests/unit/test_grammar_mask.py
echo "elapsed $(( $(date +%s) - T0 )) s"
timeout 90 python3 scripts/filter_cost.py 128256 --profile > "$R/filter_cost.txt" 2>&1
grep -E "^sample_tokens|GPU time per call" "$R/filter_cost.txt" | tail -24
fits 60 "bench 1k" && [ ! -d /tmp/models/llama3-8b ] && bench_8b D 60 1024 fp16
fits 70 "sampled bench" && [ -d /tmp/models/llama3-8b ] && { timeout 70 python3 \
  scripts/sampled_bench.py /tmp/models/llama3-8b --tokens 128 --json "$R/sampled_bench.json" \
  > "$R/sampled_bench.txt" 2>&1; echo "== sampled bench, kernel"; tail -13 "$R/sampled_bench.txt"; }
fits 50 "sampled bench torch" && { EXL2_BACKEND_FUSED_TOP_K=0 timeout 50 python3 scripts/sampled_bench.py \
  /tmp/models/llama3-8b --tokens 128 --json "$R/sampled_bench_torch.json" > "$R/sampled_bench_torch.txt" 2>&1
  echo "== torch filter path"; grep -E "greedy_lookahead|topp|nucleus" "$R/sampled_bench_torch.txt"; }
echo "total $(( $(date +%s) - T0 )) s"
