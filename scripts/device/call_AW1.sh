#!/usr/bin/env bash
# Device call AW1 (session 32; carry .whl and .dev/libexl2_kernels.so.gz, C ABI 11; ~90 s): call_AV6.sh and
# call_AV5.sh in one: the top-k sampling kernel's first GPU run (its tests and the sampler kernel's, the
# sampled-lookahead engine tests), filter_cost (one 128k row: the kernel against the torch filter path), then
# sampled_bench on the random 8B with EXL2_BACKEND_FUSED_TOP_K=1 and =0. Its one run (H100) found the kernel's
# parameters aliased (temporaries freed inside the call's argument list) and _sample_split's arguments swapped.
export EXL2_CARRIED_LIBRARY=1 EXL2_BACKEND_FUSED_TOP_K=1
source scripts/device/common.sh
begin_call aw1
nvidia-smi --query-gpu=name --format=csv,noheader
gpu_tests_verbose sampling 120 -n 3 --dist loadfile --timeout 110 tests/kernels/test_sampling_kernel.py \
  tests/engine/test_sampled_lookahead_tiny.py tests/engine/test_sampled_gpu_tiny.py tests/unit/test_filtered_probs_skip.py tests/unit/test_grammar_mask.py
echo "elapsed $(( $(date +%s) - T0 )) s"
timeout 40 python3 scripts/filter_cost.py 128256 > "$R/filter_cost.txt" 2>&1; tail -14 "$R/filter_cost.txt"
fits 60 "bench 1k" && [ ! -d /tmp/models/llama3-8b ] && bench_8b D 60 1024 fp16
fits 60 "sampled bench" && [ -d /tmp/models/llama3-8b ] && { timeout 60 python3 \
  scripts/sampled_bench.py /tmp/models/llama3-8b --tokens 128 --json "$R/sampled_bench.json" \
  > "$R/sampled_bench.txt" 2>&1; echo "== sampled bench, fused top-k"; tail -11 "$R/sampled_bench.txt"; }
fits 40 "sampled bench torch" && { EXL2_BACKEND_FUSED_TOP_K=0 timeout 40 python3 scripts/sampled_bench.py \
  /tmp/models/llama3-8b --tokens 128 --json "$R/sampled_bench_torch.json" > "$R/sampled_bench_torch.txt" 2>&1
  echo "== torch filter path"; tail -11 "$R/sampled_bench_torch.txt"; }
echo "total $(( $(date +%s) - T0 )) s"
