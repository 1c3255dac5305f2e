#!/usr/bin/env bash
# Device call B1 (fresh machine, first GGUF part): build; ExLlamaV2's JIT build in the background (kept for B2 on
# the warm machine); the GPU tests changed since call A; speculative verify cost on the 8B shape; serving
# overhead/throughput on the 8B shape; 8B-shape conversion timing. Call B2 must follow within 30 s.
source scripts/device/common.sh
mkdir -p /tmp/smol && cp .dev/gguf_part_a* /tmp/smol/ 2>/dev/null
export EXL2_BACKEND_CACHE_DIR=/tmp/exl2cache
(t0=$(date +%s); python3 -c "import exllamav2; from exllamav2.ext import exllamav2_ext" > "$OUT/exl_jit.txt" 2>&1;
 echo "jit rc=$? in $(( $(date +%s) - t0 )) s" >> "$OUT/exl_jit.txt") &
JIT=$!
timeout 150 python3 -m pytest tests/kernels/test_exl2_gemm.py tests/kernels/test_kv_quant_kernels.py \
  tests/unit/test_convert_device.py tests/multigpu/test_multigpu_cuda.py tests/kernels/test_paged_attention.py \
  -q -m cuda -p no:cacheprovider --timeout 100 -rf 2>&1 | tee "$OUT/cuda_tests_b1.txt" | grep -E "FAILED|passed|failed" | tail -12
python3 -c "from exl2_backend.format.random_model import write_random_exl2_model as w; w('/tmp/models/llama3-8b', 'llama3-8b', bpw=4.0)"
timeout 120 python3 scripts/spec_bench.py --skip smollm2 --out "$OUT/spec_costs.json" 2> "$OUT/spec_costs.log"; tail -6 "$OUT/spec_costs.log"
timeout 200 python3 scripts/serve_bench.py --shape llama3-8b --bpw 4.0 --model-out /tmp/models/llama3-8b --device cuda \
  --streams 1,8,32 --max-tokens 256 --reps 2 --compare fast_queue=true \
  --json "$OUT/serve_bench.json" > "$OUT/serve_bench.txt" 2>&1; tail -16 "$OUT/serve_bench.txt"
timeout 90 python3 scripts/convert_timing.py --out "$OUT" --shape llama3-8b --layers 4 2>&1 | tail -2
wait $JIT; tail -1 "$OUT/exl_jit.txt"
