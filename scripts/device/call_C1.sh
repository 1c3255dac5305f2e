#!/usr/bin/env bash
# Device call C1 (fresh machine; carries .whl, .dev/libexl2_kernels.so.gz built here for sm_90a, .dev/gguf_part_aa):
# ExLlamaV2's JIT build in the background (for C2 on the warm machine); the GPU tests that need no SmolLM2;
# speculative step costs on the 8B/1B shapes; serving overhead and throughput on the 8B shape; 8B-shape
# conversion wall time. C2 must follow within 30 s.
export EXL2_CARRIED_LIBRARY=1
source scripts/device/common.sh
mkdir -p /tmp/smol && cp .dev/gguf_part_a* /tmp/smol/ 2>/dev/null
export EXL2_BACKEND_CACHE_DIR=/tmp/exl2cache
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.max.mem --format=csv,noheader
start_exllamav2_jit
t=$(date +%s)
timeout 140 python3 -m pytest $CUDA_TESTS_NO_SMOLLM2 -q -m cuda -p no:cacheprovider --timeout 100 -rf -x 2>&1 | tee "$OUT/cuda_tests_c1.txt" | grep -E "FAILED|passed|failed|Error" | tail -12
echo "tests $(( $(date +%s) - t )) s"; t=$(date +%s)
python3 -c "from exl2_backend.format.random_model import write_random_exl2_model as w; w('/tmp/models/llama3-8b', 'llama3-8b', bpw=4.0)"
timeout 110 python3 scripts/spec_bench.py --skip smollm2 --iters 30 --work-dir /tmp/spec_bench --out "$OUT/spec_costs.json" \
  2> "$OUT/spec_costs.log"; tail -8 "$OUT/spec_costs.log"; cp /tmp/spec_bench/costs.json "$OUT/" 2>/dev/null
echo "spec $(( $(date +%s) - t )) s"; t=$(date +%s)
timeout 150 python3 scripts/serve_bench.py --shape llama3-8b --bpw 4.0 --model-out /tmp/models/llama3-8b --device cuda \
  --streams 1,8,32 --max-tokens 256 --reps 2 --json "$OUT/serve_bench.json" > "$OUT/serve_bench.txt" 2>&1
tail -16 "$OUT/serve_bench.txt"
echo "serve $(( $(date +%s) - t )) s"; t=$(date +%s)
timeout 80 python3 scripts/convert_timing.py --out "$OUT" --shape llama3-8b --layers 2 --tf32 2>&1 | tail -3
echo "convert timing $(( $(date +%s) - t )) s"
wait $JIT; tail -1 "$OUT/exl_jit.txt"
