#!/usr/bin/env bash
# Device call AV5 (session 31; carry .whl and .dev/libexl2_kernels.so.gz, C ABI 11; ~250 s): the top-k sampling
# kernel (csrc/layers/sampling_top_k.cu, ops/cuda_sampling_top_k.py). Its tests and the sampler kernel's (every
# batch against the reference, ties straddling k, split batches, faults, the switch, no host sync) and the
# sampled-lookahead engine tests; then sampled_bench on the random 8B (the H200's
# AV3 before it: top-k 50 + top-p 0.9 at 2.453 ms against greedy 2.201), and with EXL2_BACKEND_FUSED_TOP_K=0.
export EXL2_CARRIED_LIBRARY=1 EXL2_BACKEND_FUSED_TOP_K=1
source scripts/device/common.sh
begin_call av5
nvidia-smi --query-gpu=name --format=csv,noheader
gpu_tests_verbose sampling 120 -n 3 --dist loadfile --timeout 110 tests/kernels/test_sampling_kernel.py \
  tests/engine/test_sampled_lookahead_tiny.py
echo "elapsed $(( $(date +%s) - T0 )) s"
fits 60 "bench 1k" && [ ! -d /tmp/models/llama3-8b ] && bench_8b D 60 1024 fp16
fits 60 "sampled bench" && [ -d /tmp/models/llama3-8b ] && { timeout 60 python3 \
  scripts/sampled_bench.py /tmp/models/llama3-8b --tokens 128 --json "$R/sampled_bench.json" \
  > "$R/sampled_bench.txt" 2>&1; echo "== sampled bench"; tail -11 "$R/sampled_bench.txt"; }
EXL2_BACKEND_FUSED_TOP_K=0 timeout 30 python3 scripts/sampled_bench.py /tmp/models/llama3-8b --tokens 128 \
  --json "$R/sampled_bench_torch.json" > "$R/sampled_bench_torch.txt" 2>&1; echo "== torch filter path"; \
  grep topp "$R/sampled_bench_torch.txt"
echo "total $(( $(date +%s) - T0 )) s"
