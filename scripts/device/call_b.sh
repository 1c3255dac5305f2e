#!/usr/bin/env bash
# Device call B: reassemble the SmolLM2 GGUF (parts carried by calls A and B), then the GPU-vs-reference
# tests on the real model, every cuda-marked test, and the default model's benchmark.
source scripts/device/common.sh
mkdir -p /tmp/smol && cp .dev/gguf_part_a* /tmp/smol/ 2>/dev/null
if [ "$(ls /tmp/smol | wc -l)" -ge 3 ]; then
  cat /tmp/smol/gguf_part_a* > /tmp/smol.gguf && export EXL2_BACKEND_DEFAULT_GGUF=/tmp/smol.gguf
fi
export EXL2_BACKEND_CACHE_DIR=/tmp/exl2cache
python3 -m pytest tests -q -m cuda -p no:cacheprovider --durations=10 2>&1 | tee "$OUT/cuda_tests.txt" | tail -25
exl2 bench --contexts 512,2048,8192 --decode-tokens 128 --json "$OUT/bench_default.json" 2>&1 | tail -10
