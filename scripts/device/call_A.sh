#!/usr/bin/env bash
# Device call A (no SmolLM2 needed): build; ExLlamaV2's JIT build in the background while every cuda test runs;
# then the 8B-shape bench (1k and 32k context, fp16/q8/q4 caches), ExLlamaV2 0.3.2 on the same directory,
# the 1B shape, and prefix-cache TTFT + 128k prefill memory. Keeps the first GGUF part in /tmp/smol for a later call.
source scripts/device/common.sh
mkdir -p /tmp/smol && cp .dev/gguf_part_a* /tmp/smol/ 2>/dev/null
export EXL2_BACKEND_CACHE_DIR=/tmp/exl2cache
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader | tee "$OUT/gpu.txt"
start_exllamav2_jit
timeout 240 python3 -m pytest tests/kernels tests/engine tests/unit tests/spec tests/multigpu tests/serve -q -m cuda \
  -p no:cacheprovider --timeout 120 -rf 2>&1 | tee "$OUT/cuda_tests.txt" | grep -E "FAILED|ERROR|passed|failed" | tail -25
wait $JIT; tail -2 "$OUT/exl_jit.txt"
timeout 200 python3 -m exl2_backend.cli.main bench --shape llama3-8b --bpw 4.0 --model-out /tmp/models/llama3-8b \
  --contexts 1024,32768 --cache-type fp16,q8,q4 --decode-tokens 96 --json "$OUT/bench_8b.json" \
  --plot "$OUT/bench_8b.png" > "$OUT/bench_8b.txt" 2>&1; grep -v "^\[" "$OUT/bench_8b.txt" | tail -30
timeout 150 python3 scripts/device/exllamav2_compare.py --out "$OUT" --random-dir /tmp/models/llama3-8b \
  --smol-dir /nonexistent --context 1024 > "$OUT/exllamav2_8b.txt" 2>&1; tail -40 "$OUT/exllamav2_8b.txt" | grep -E "tok|speed|kl|top1|max" | head -30
timeout 100 python3 -m exl2_backend.cli.main bench --shape llama3-1b --bpw 4.0 --model-out /tmp/models/llama3-1b \
  --contexts 1024 --decode-tokens 128 --json "$OUT/bench_1b.json" 2>&1 | grep -v "^\[" | tail -8
timeout 150 python3 scripts/prefix_prefill.py /tmp/models/llama3-8b --json "$OUT/prefix_prefill.json" 2>&1 \
  | tee "$OUT/prefix_prefill.txt" | tail -5
