#!/usr/bin/env bash
# Device call (~3 min on one H200): serving overhead and throughput on the random llama3-8b shape, 4.0 bpw.
# 1. GPU batch invariance (16 concurrent greedy streams vs each alone, tests/serve/test_batch_invariance.py -m cuda).
# 2. scripts/serve_bench.py: direct engine vs direct hooks vs server (1 stream: overhead %, TTFT delta),
#    aggregate tok/s at 1, 8 and 32 streams, and single streams over LitServe's ZeroMQ transport (fast_queue) for comparison.
# Results: $OUT/serve_bench.json, $OUT/serve_bench.txt, $OUT/batch_invariance_gpu.txt.
source scripts/device/common.sh
python3 -m pytest tests/serve/test_batch_invariance.py -q -s -m cuda -p no:cacheprovider 2>&1 \
  | tee "$OUT/batch_invariance_gpu.txt" | tail -4
python3 scripts/serve_bench.py --shape llama3-8b --bpw 4.0 --model-out /tmp/models/llama3-8b --device cuda \
  --streams 1,8,32 --max-tokens 256 --reps 3 --compare fast_queue=true \
  --json "$OUT/serve_bench.json" 2>&1 | tee "$OUT/serve_bench.txt" | tail -14
