#!/usr/bin/env bash
# Device call: build, every cuda-marked kernel/engine test, the decode-step profile (PDL and silu-into-down
# variants, per-kernel table) and the 8B-shape bench. Results under $OUT.
source scripts/device/common.sh
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader | tee "$OUT/gpu.txt"
timeout 240 python3 -m pytest tests/kernels tests/engine tests/unit -q -m cuda -p no:cacheprovider -x --timeout 120 \
  2>&1 | tee "$OUT/cuda_tests.txt" | tail -6
timeout 200 python3 scripts/profile_decode.py --shapes smollm2,llama3-8b --variants before,pdl,silu,after \
  --out "$OUT" > "$OUT/profile_decode.txt" 2>&1; tail -12 "$OUT/profile_decode.txt"
grep -E "greedy|graph before" "$OUT/profile_decode.txt" | head -5
timeout 150 python3 -m exl2_backend.cli.main bench --shape llama3-8b --bpw 4.0 --model-out /tmp/models/llama3-8b \
  --contexts 512,2048,32768 --decode-tokens 128 --json "$OUT/bench_llama3-8b.json" 2>&1 | tail -9
