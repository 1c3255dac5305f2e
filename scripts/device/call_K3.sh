#!/usr/bin/env bash
# Device call K3 (session 7): the final defaults (tensor-core attention for quantized pages with the first-K-rows
# prefetch, for fp16 pages from 16 rows per kv head), carry .whl and .dev/libexl2_kernels.so.gz:
#  1. the fp16-page attention tests and the batch-invariance tests;
#  2. the 8B at 1k and 32k for fp16 / q8 / q4, verify costs (spec_bench);
#  3. ExLlamaV2 0.3.2 at 32k with its fp16 and Q4 caches, ours on the same directory in the same call.
export EXL2_CARRIED_LIBRARY=1
source scripts/device/common.sh
results_dir
trap '[ -d "$R" ] && pack_results k3' EXIT
t=$(date +%s)
gpu_tests tests 90 tests/kernels/test_paged_attention.py tests/serve/test_batch_invariance.py --timeout 60
echo "tests $(( $(date +%s) - t )) s"; t=$(date +%s)
start_exllamav2_jit
timeout 100 python3 -m exl2_backend.cli.main bench --shape llama3-8b --bpw 4.0 --model-out /tmp/models/llama3-8b \
  --contexts 1024,32768 --cache-type fp16,q8,q4 --json "$R/bench_8b.json" --plot "$R/bench_8b.png" \
  > "$R/bench_8b.txt" 2>&1
grep -A7 "decode tokens/s by cache" "$R/bench_8b.txt" | tail -3
timeout 50 python3 scripts/spec_bench.py --skip smollm2 --iters 30 --work-dir /tmp/spec_bench \
  --out "$R/spec_costs.json" 2> "$R/spec_costs.log"
grep 'step costs' "$R/spec_costs.log" | tail -1
echo "bench $(( $(date +%s) - t )) s"; t=$(date +%s)
wait $JIT; tail -1 "$OUT/exl_jit.txt"; cp "$OUT/exl_jit.txt" "$R/" 2>/dev/null; rm -f "$OUT/exl_jit.txt"
timeout 240 python3 scripts/device/exllamav2_compare.py --out "$R" --random-dir /tmp/models/llama3-8b --ours \
  --skip-compat --context 32768 --decode-tokens 64 --cache-types fp16,q4 > "$R/exl_compare.txt" 2>&1
grep -E "exllamav2 no_sdpa|ours:" "$R/exl_compare.txt" | cut -c1-220
echo "exllamav2 $(( $(date +%s) - t )) s"
