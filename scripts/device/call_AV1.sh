#!/usr/bin/env bash
# Device call AV1 (session 31; carry .whl and .dev/libexl2_kernels.so.gz; ~200 s): session 30's AU1, which never
# ran, plus session 31's bounded sort. Both samplers skip the filters no sampled row uses (the reference its sort
# too; speculative decoding's rejection sampling runs the reference on GPU tensors) and sort only to the largest
# top-k when every sampled row has one. The sampler kernel's tests (its top-k / top-p / min-p batches against the
# reference, the bounded sort against the full one), the sampled-lookahead engine tests and speculative decoding
# on small random models, then bench 1k (writes the random 8B) and sampled_bench (AT1 on an H100: top-k + top-p
# 2.627 ms against greedy 2.311).
export EXL2_CARRIED_LIBRARY=1
source scripts/device/common.sh
begin_call av1
nvidia-smi --query-gpu=name --format=csv,noheader
gpu_tests_verbose sampling 120 -n 3 --dist loadfile --timeout 110 tests/kernels/test_sampling_kernel.py \
  tests/engine/test_sampled_lookahead_tiny.py tests/spec/test_spec_gpu_tiny.py
echo "elapsed $(( $(date +%s) - T0 )) s"
fits 60 "bench 1k" "${AV1_LIMIT:-300}" && bench_8b D 60 1024 fp16
fits 60 "sampled bench" "${AV1_LIMIT:-300}" && [ -d /tmp/models/llama3-8b ] && { timeout 60 python3 \
  scripts/sampled_bench.py /tmp/models/llama3-8b --tokens 128 --json "$R/sampled_bench.json" \
  > "$R/sampled_bench.txt" 2>&1; echo "== sampled bench"; tail -11 "$R/sampled_bench.txt"; }
echo "total $(( $(date +%s) - T0 )) s"
