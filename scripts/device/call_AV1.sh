#!/usr/bin/env bash
# Device call AV1 (session 31; carry .whl (with exllamav2 0.3.2) and .dev (libexl2_kernels.so.gz, cvt_tiny); ~420 s).
# 1. Session 30's AU1, which never ran, with session 31's bounded sort: both samplers skip the filters no sampled
#    row uses (the reference its sort too; speculative decoding's rejection sampling runs the reference on GPU
#    tensors) and sort only to the largest top-k when every sampled row has one. The sampler kernel's tests (its
#    top-k / top-p / min-p batches against the reference, the bounded sort against the full one), the
#    sampled-lookahead engine tests and speculative decoding on small random models; then bench 1k (writes the
#    random 8B) and sampled_bench (AT1 on an H100: top-k + top-p 2.627 ms against greedy 2.311).
# 2. ExLlamaV2 loads the converter's output: .dev/cvt_tiny is a random SmolLM2-shaped model (4 layers, vocabulary
#    8,192) converted by `exl2-backend convert --bpw 4.0` (GPTQ, measured options, act-order) on the CPU; its
#    logits in ExLlamaV2 against ours (exllamav2_compare.py --compat-only). Then, time permitting, ExLlamaV2's 1k
#    decode beside ours on the random 8B.
export EXL2_CARRIED_LIBRARY=1
source scripts/device/common.sh
begin_call av1
nvidia-smi --query-gpu=name --format=csv,noheader
start_exllamav2_jit
gpu_tests_verbose sampling 120 -n 3 --dist loadfile --timeout 110 tests/kernels/test_sampling_kernel.py \
  tests/engine/test_sampled_lookahead_tiny.py tests/spec/test_spec_gpu_tiny.py
echo "elapsed $(( $(date +%s) - T0 )) s"
fits 60 "bench 1k" && bench_8b D 60 1024 fp16
fits 60 "sampled bench" && [ -d /tmp/models/llama3-8b ] && { timeout 60 python3 \
  scripts/sampled_bench.py /tmp/models/llama3-8b --tokens 128 --json "$R/sampled_bench.json" \
  > "$R/sampled_bench.txt" 2>&1; echo "== sampled bench"; tail -11 "$R/sampled_bench.txt"; }
echo "elapsed $(( $(date +%s) - T0 )) s"
wait $JIT; tail -1 "$OUT/exl_jit.txt"; cp "$OUT/exl_jit.txt" "$R/" 2>/dev/null; rm -f "$OUT/exl_jit.txt"
fits 60 "exllamav2 compat" && { timeout 60 python3 scripts/device/exllamav2_compare.py --out "$R" \
  --compat-only .dev/cvt_tiny --random-ids --tokens 256 > "$R/exl_compat.txt" 2>&1
  echo "== exllamav2 on the converter's output"; grep -E "compat|Error|error" "$R/exl_compat.txt" | cut -c1-240; }
fits 150 "exllamav2 1k" && exllamav2_vs_ours "$(left 560)"
echo "total $(( $(date +%s) - T0 )) s"
