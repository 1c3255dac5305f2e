#!/usr/bin/env bash
# Device call AT1 (session 30; carry .whl and .dev/libexl2_kernels.so.gz; ~420 s):
#  1. GPU tests: the decode lookahead with sampled sequences (tests/engine/test_sampled_lookahead_tiny.py: seeded
#     tokens and logprobs equal eager sampling with greedy, biased, penalized, min_tokens, top-k / top-p / min-p rows,
#     across releases, batch changes and a verify step; grammar batches deferred; sampling never waits for the
#     device), the lookahead and eager
#     sampling tiny-model tests (eager sampling now runs the sampler kernel, uniforms from GPU generators), the
#     sampler kernel's tests, and session 28's speculative decoding on small random models
#     (tests/spec/test_spec_gpu_tiny.py, never run on a GPU).
#  2. bench 1k fp16 on the random 8B (writes it), then scripts/sampled_bench.py on it: ms per token of greedy,
#     temperature and top-p sampling, each with the lookahead, eager, and eager on the reference's torch-op sampler.
export EXL2_CARRIED_LIBRARY=1
source scripts/device/common.sh
begin_call at1
nvidia-smi --query-gpu=name --format=csv,noheader
gpu_tests_verbose engine 250 -n 4 --dist loadfile --timeout 200 tests/engine/test_sampled_lookahead_tiny.py \
  tests/engine/test_lookahead_tiny.py tests/engine/test_sampled_gpu_tiny.py tests/kernels/test_sampling_kernel.py \
  tests/spec/test_spec_gpu_tiny.py
echo "elapsed $(( $(date +%s) - T0 )) s"
fits 100 "bench 1k" "${AT1_LIMIT:-560}" && bench_8b D 100 1024 fp16
fits 70 "sampled bench" "${AT1_LIMIT:-560}" && [ -d /tmp/models/llama3-8b ] && { timeout 70 python3 \
  scripts/sampled_bench.py /tmp/models/llama3-8b --tokens 128 --json "$R/sampled_bench.json" \
  > "$R/sampled_bench.txt" 2>&1; echo "== sampled bench"; tail -10 "$R/sampled_bench.txt"; }
echo "total $(( $(date +%s) - T0 )) s"
