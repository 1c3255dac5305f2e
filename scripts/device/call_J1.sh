#!/usr/bin/env bash
# Device call J1 (prepared in session 6 for the next one; carry .whl and .dev/libexl2_kernels.so.gz, rebuilt after
# any csrc change):
#  1. the GPU tests without SmolLM2, whole (I4's 60 s limit cut test_kv_quant_kernels.py after 185 tests; the new
#     test_combine_staged_past_48kb_is_bit_identical compares EXL2_ATTN_COMBINE_MAX_KB=200 with the loop);
#  2. the 8B at 32k, fp16 and q8, with the reduce staged past 48 KB (q8: 99 splits, 51.5 KB per row) and without,
#     and the q8 critical path with it.
export EXL2_CARRIED_LIBRARY=1
source scripts/device/common.sh
results_dir
trap '[ -d "$R" ] && pack_results j1' EXIT
t=$(date +%s)
gpu_tests tests 240 $CUDA_TESTS_NO_SMOLLM2 --timeout 120
echo "tests $(( $(date +%s) - t )) s"; t=$(date +%s)
for kb in 48 200; do
  EXL2_ATTN_COMBINE_MAX_KB=$kb timeout 90 python3 -m exl2_backend.cli.main bench --shape llama3-8b --bpw 4.0 \
    --model-out /tmp/models/llama3-8b --contexts 1024,32768 --cache-type fp16,q8 --json "$R/bench_8b_kb$kb.json" \
    > "$R/bench_8b_kb$kb.txt" 2>&1
  echo "combine <= $kb KB:"; grep -A5 "decode tokens/s by cache" "$R/bench_8b_kb$kb.txt" | tail -2
done
echo "bench $(( $(date +%s) - t )) s"; t=$(date +%s)
EXL2_ATTN_COMBINE_MAX_KB=200 timeout 60 python3 scripts/profile_decode.py --shapes llama3-8b --variants after \
  --workdir /tmp/prof --no-check --context 32768 --cache-types q8 --out "$R/p32k" > "$R/profile_32k_q8.txt" 2>&1
grep -E "^######## " "$R/profile_32k_q8.txt"; grep -A6 "critical path" "$R/profile_32k_q8.txt" | grep -E "attention|reduce|kv_quant|gemv"
echo "profile $(( $(date +%s) - t )) s"
