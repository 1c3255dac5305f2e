#!/usr/bin/env bash
# Device call K4 (session 7): the tensor-core attention kernel with twice the key steps in flight
# (EXL2_ATTN_QUANT_MMA_DEEP=1: 4 / 2 steps in the scores / output phase, 168 registers, 3 CTAs per SM) against
# the default (2 / 1, 128 registers): its tests, the 32k sweep at 3 and 4 CTAs per SM, the 8B at 32k.
export EXL2_CARRIED_LIBRARY=1
source scripts/device/common.sh
results_dir
trap '[ -d "$R" ] && pack_results k4' EXIT
t=$(date +%s)
EXL2_ATTN_QUANT_MMA_DEEP=1 gpu_tests kvq_deep 70 tests/kernels/test_kv_quant_kernels.py -k "not cuda_core" --timeout 60
echo "tests $(( $(date +%s) - t )) s"; t=$(date +%s)
for deep in 0 1; do
  EXL2_ATTN_QUANT_MMA_DEEP=$deep timeout 30 python3 scripts/attention_sweep.py --context 32768 --types q8,q4 \
    --ctas 3,4 --json "$R/sweep_deep$deep.json" > "$R/sweep_deep$deep.txt" 2>&1
  echo "deep=$deep:"; grep "ctas/SM" "$R/sweep_deep$deep.txt"
done
echo "sweep $(( $(date +%s) - t )) s"; t=$(date +%s)
EXL2_ATTN_QUANT_MMA_DEEP=1 EXL2_BACKEND_ATTN_CTAS_PER_SM=${K4_CTAS:-4} timeout 70 python3 -m exl2_backend.cli.main bench \
  --shape llama3-8b --bpw 4.0 --model-out /tmp/models/llama3-8b --contexts 32768 --cache-type q8,q4 \
  --json "$R/bench_8b_deep.json" > "$R/bench_8b_deep.txt" 2>&1
grep -A6 "decode tokens/s by cache" "$R/bench_8b_deep.txt" | tail -2
echo "bench $(( $(date +%s) - t )) s"
