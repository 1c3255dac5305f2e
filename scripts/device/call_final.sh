#!/usr/bin/env bash
# Device call: build, every cuda test, the 8B-shape bench, and serving overhead through LitServe on the GPU.
source scripts/device/common.sh
python3 -m pytest tests -q -m cuda -p no:cacheprovider --ignore=tests/serve --ignore=integration 2>&1 \
  | tee "$OUT/cuda_tests.txt" | tail -4
exl2 bench --shape llama3-8b --bpw 4.0 --model-out /tmp/models/llama3-8b --contexts 512,2048,8192,32768 \
  --decode-tokens 128 --json "$OUT/bench_llama3-8b.json" --plot "$OUT/bench_llama3-8b.png" 2>&1 | tail -11
python3 scripts/serve_bench.py /tmp/models/llama3-8b --device cuda --streams 1,8,32 --max-tokens 128 2>&1 \
  | tee "$OUT/serve_bench.txt" | tail -8
