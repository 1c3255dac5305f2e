#!/usr/bin/env bash
# Device call: quantized KV cache types (fp8/q8/q6/q4) on the H200, ~3 minutes of GPU time.
#  1. the quantized write/attention kernel tests (exact codes, attention vs reference), stop at the first failure;
#  2. attention-kernel GB/s per cache type at 8k/32k context and the quantize-on-write kernel time;
#  3. KL of each cache type vs the fp16-cache run of SmolLM2 (GGUF parts carried like call B; skipped without);
#  4. decode tok/s of a random Llama-3-8B-shape 4.0 bpw model at 2k/32k context with fp16, q8 and q4 caches.
# Results: $OUT/kvcache_tests.txt, kvcache_attention.json, kvcache_quality.json, bench_kvcache.json/.png.
source scripts/device/common.sh
export EXL2_BACKEND_CACHE_DIR=/tmp/exl2cache
python3 -m pytest tests/kernels/test_kv_quant_kernels.py -x -q -p no:cacheprovider 2>&1 \
  | tee "$OUT/kvcache_tests.txt" | tail -6
python3 scripts/kvcache_device.py attention --contexts 8192 32768 2>&1 | tee "$OUT/kvcache_attention.txt"
mkdir -p /tmp/smol && cp .dev/gguf_part_a* /tmp/smol/ 2>/dev/null
if [ "$(ls /tmp/smol | wc -l)" -ge 3 ]; then
  cat /tmp/smol/gguf_part_a* > /tmp/smol.gguf && export EXL2_BACKEND_DEFAULT_GGUF=/tmp/smol.gguf
fi
timeout 300 python3 scripts/kvcache_device.py quality --window 2048 --max-tokens 16384 2>&1 \
  | tee "$OUT/kvcache_quality.txt" | grep -E "quality|Error" || echo "quality: skipped (default model unavailable)"
exl2 bench --shape llama3-8b --bpw 4.0 --model-out /tmp/models/llama3-8b --contexts 2048,32768 \
  --cache-type fp16,q8,q4 --decode-tokens 64 --prefill-tokens 512 \
  --json "$OUT/bench_kvcache.json" --plot "$OUT/bench_kvcache.png" 2>&1 | tee "$OUT/bench_kvcache.txt" | tail -24
