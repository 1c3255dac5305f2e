#!/usr/bin/env bash
# Device call A: build, every CUDA kernel test, and the random-shape decode/prefill benchmarks.
# Keeps the first part of the SmolLM2 GGUF in /tmp/smol for call B (the file is too large for one call).
source scripts/device/common.sh
mkdir -p /tmp/smol && cp .dev/gguf_part_a* /tmp/smol/ 2>/dev/null
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,memory.used --format=csv | tee "$OUT/gpu.txt"
python3 -m pytest tests/kernels -q -m cuda -p no:cacheprovider 2>&1 | tee "$OUT/kernels.txt" | tail -15
for shape in llama3-8b llama3-1b; do
  ctx="512,2048,8192,32768"; [ "$shape" = llama3-1b ] && ctx="512,2048"
  exl2 bench --shape "$shape" --bpw 4.0 --model-out "/tmp/models/$shape" --contexts "$ctx" --decode-tokens 128 \
    --json "$OUT/bench_$shape.json" --plot "$OUT/bench_$shape.png" 2>&1 | tee "$OUT/bench_$shape.txt" | tail -14
done
