#!/usr/bin/env bash
# Device call: speculative decoding. The cuda-marked spec tests (greedy identity on the GPU, verify graphs vs
# eager, draft graphs, a draft that does not fit), then scripts/spec_bench.py -> $OUT/spec_bench.json:
# 8B-shape verify vs decode step costs, SmolLM2 6.0/2.5 bpw acceptance and tokens/s per workload, expected 8B
# speedup with a 1B-shape draft. Needs the SmolLM2 GGUF parts in .dev/ (or /tmp/smol from an earlier call) for
# everything but the step costs.
source scripts/device/common.sh
mkdir -p /tmp/smol && cp .dev/gguf_part_a* /tmp/smol/ 2>/dev/null
if [ "$(ls /tmp/smol | wc -l)" -ge 3 ]; then
  cat /tmp/smol/gguf_part_a* > /tmp/smol.gguf && export EXL2_BACKEND_DEFAULT_GGUF=/tmp/smol.gguf
fi
export EXL2_BACKEND_CACHE_DIR=/tmp/exl2cache
timeout 300 python3 -m pytest tests/spec -q -m cuda -p no:cacheprovider --timeout 240 2>&1 \
  | tee "$OUT/spec_cuda_tests.txt" | tail -8
timeout 330 python3 scripts/spec_bench.py --out "$OUT/spec_bench.json" 2> "$OUT/spec_bench.log"
tail -12 "$OUT/spec_bench.log"
