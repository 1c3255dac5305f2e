#!/usr/bin/env bash
# Device call D1 (next session; fresh machine; carry .whl and .dev/libexl2_kernels.so.gz, regenerated here with
# `gzip -9 -c exl2_backend/_lib/libexl2_kernels.so > .dev/libexl2_kernels.so.gz` after any csrc change):
#  1. the GPU tests fixed without a GPU on 2026-12-01 (gated GEMV bound, GPU-vs-CPU conversion) and the rest
#     of the GPU tests that need no SmolLM2;
#  2. ExLlamaV2 0.3.2 loading the converter's own output (a GPU conversion of a 2-layer llama3-8b-shape FP16
#     model with random weights, all options measured), logits compared with ours;
#  3. the kernel tables of the 8B decode and verify graphs (why a k = 4 verify costs 1.47x a decode step);
#  4. serving overhead with the timed request warmed up.
export EXL2_CARRIED_LIBRARY=1
source scripts/device/common.sh
start_exllamav2_jit
t=$(date +%s)
timeout 150 python3 -m pytest $CUDA_TESTS_NO_SMOLLM2 -q -m cuda -p no:cacheprovider --timeout 100 -rf 2>&1 | tee "$OUT/cuda_tests_d1.txt" | grep -E "FAILED|passed|failed|Error" | tail -12
echo "tests $(( $(date +%s) - t )) s"; t=$(date +%s)
timeout 90 python3 scripts/convert_timing.py --out "$OUT" --shape llama3-8b --layers 2 --tf32 2>&1 | tail -1
echo "convert $(( $(date +%s) - t )) s"; t=$(date +%s)
python3 -c "from exl2_backend.format.random_model import write_random_exl2_model as w; w('/tmp/models/llama3-8b', 'llama3-8b', bpw=4.0)"
timeout 60 python3 scripts/spec_bench.py --skip smollm2 --kernels --iters 30 --work-dir /tmp/spec_bench \
  --out "$OUT/spec_costs_kernels.json" 2> "$OUT/spec_costs.log"; tail -2 "$OUT/spec_costs.log"
echo "spec $(( $(date +%s) - t )) s"; t=$(date +%s)
timeout 120 python3 scripts/serve_bench.py --shape llama3-8b --bpw 4.0 --model-out /tmp/models/llama3-8b --device cuda \
  --streams 1,8,32 --max-tokens 256 --reps 3 --json "$OUT/serve_bench.json" > "$OUT/serve_bench.txt" 2>&1
tail -8 "$OUT/serve_bench.txt"
echo "serve $(( $(date +%s) - t )) s"; t=$(date +%s)
wait $JIT; tail -1 "$OUT/exl_jit.txt"
timeout 90 python3 scripts/device/exllamav2_compare.py --out "$OUT" --compat-only /tmp/convert_timing/exl2_llama3-8b_L2 \
  --random-ids 2>&1 | tail -3
echo "compat $(( $(date +%s) - t )) s"
