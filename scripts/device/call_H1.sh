#!/usr/bin/env bash
# Device call H1 (prepared in session 5 for the next one; carry .whl and .dev/libexl2_kernels.so.gz, rebuilt after
# any csrc change). Runs what session 5 set as defaults without device time left to run them as defaults, and
# the next verify-cost lever:
#  1. the GPU tests without SmolLM2 (kernels incl. the pre-gather and row-tile-cap tests, convert, multigpu,
#     prefill memory, batch invariance);
#  2. verify costs with the defaults (pre-gather where a block gathers >= 3,072 items; G3 had 1.43x at k = 4 with
#     it from M = 2) and with the attention row tile capped at 8 and 4 (a k = 4 verify's 20 rows per kv head in
#     3 or 5 tiles instead of 2 of 16; G1's tables: attention 832 us per verify step against 262 per decode),
#     and with the split-K partials summed four columns per item (EXL2_GEMV_REDUCE=vec4: at M = 5 and 16
#     splits, 2 rounds of L2 latency instead of 5);
#  3. the 8B decode at 1k and 32k by cache type with the per-type attention splits (q8 at 6 CTAs per SM).
export EXL2_CARRIED_LIBRARY=1
source scripts/device/common.sh
results_dir
trap '[ -d "$R" ] && pack_results h1' EXIT
t=$(date +%s)
gpu_tests tests 300 $CUDA_TESTS_NO_SMOLLM2 --timeout 120
echo "tests $(( $(date +%s) - t )) s"; t=$(date +%s)
for cfg in "16 scalar" "8 scalar" "4 scalar" "16 vec4"; do
  set -- $cfg
  EXL2_BACKEND_ATTN_MAX_ROW_TILE=$1 EXL2_GEMV_REDUCE=$2 timeout 50 python3 scripts/spec_bench.py --skip smollm2 \
    --iters 30 --work-dir /tmp/spec_bench --out "$R/spec_costs_rt$1_$2.json" 2> "$R/spec_costs_rt$1_$2.log"
  echo "row tile <= $1, split-K sum $2: $(grep 'step costs' "$R/spec_costs_rt$1_$2.log" | tail -1)"
done
echo "verify $(( $(date +%s) - t )) s"; t=$(date +%s)
timeout 110 python3 -m exl2_backend.cli.main bench --shape llama3-8b --bpw 4.0 --model-out /tmp/models/llama3-8b \
  --contexts 1024,32768 --cache-type fp16,q8,q4 --json "$R/bench_8b.json" --plot "$R/bench_8b.png" > "$R/bench_8b.txt" 2>&1
grep -A6 "decode tokens/s by cache" "$R/bench_8b.txt" | tail -3
echo "bench $(( $(date +%s) - t )) s"
