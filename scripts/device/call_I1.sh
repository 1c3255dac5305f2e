#!/usr/bin/env bash
# Device call I1 (session 6; carry .whl and .dev/libexl2_kernels.so.gz, rebuilt after the csrc change):
#  1. the GPU tests without SmolLM2, with the new norm-fused GEMV tests (bit-identity with add_rms_norm + GEMV);
#  2. the 8B decode step with add_rms_norm inside the next GEMV (after) and apart (nonorm), and the greedy check
#     (the 2026-11-29 path against the default: same tokens, bit-identical logits);
#  3. verify costs with the new defaults (attention row tile 4, split-K sum four columns per item);
#  4. the 8B bench at 1k and 32k for fp16 / q8 / q4 caches;
#  5. ExLlamaV2 0.3.2 on the same 8B directory with our bench beside it (--ours), in this run.
export EXL2_CARRIED_LIBRARY=1
source scripts/device/common.sh
results_dir
trap '[ -d "$R" ] && pack_results i1' EXIT
start_exllamav2_jit
t=$(date +%s)
gpu_tests tests 200 $CUDA_TESTS_NO_SMOLLM2 --timeout 120
echo "tests $(( $(date +%s) - t )) s"; t=$(date +%s)
timeout 120 python3 scripts/profile_decode.py --shapes llama3-8b --variants after,nonorm --workdir /tmp/prof \
  --out "$R" > "$R/profile.txt" 2>&1
grep -E "^######## |graph before/after" "$R/profile.txt" | sed 's/.*\/ //'
echo "profile $(( $(date +%s) - t )) s"; t=$(date +%s)
timeout 50 python3 scripts/spec_bench.py --skip smollm2 --iters 30 --work-dir /tmp/spec_bench \
  --out "$R/spec_costs.json" 2> "$R/spec_costs.log"
grep 'step costs' "$R/spec_costs.log" | tail -1
timeout 110 python3 -m exl2_backend.cli.main bench --shape llama3-8b --bpw 4.0 --model-out /tmp/models/llama3-8b \
  --contexts 1024,32768 --cache-type fp16,q8,q4 --json "$R/bench_8b.json" --plot "$R/bench_8b.png" > "$R/bench_8b.txt" 2>&1
grep -A6 "decode tokens/s by cache" "$R/bench_8b.txt" | tail -3
timeout 40 python3 scripts/bench_gemm.py --m1 > "$R/m1.txt" 2>&1; grep M1 "$R/m1.txt" | head -6
echo "bench $(( $(date +%s) - t )) s"; t=$(date +%s)
wait $JIT; tail -1 "$OUT/exl_jit.txt"; cp "$OUT/exl_jit.txt" "$R/" 2>/dev/null; rm -f "$OUT/exl_jit.txt"
timeout 200 python3 scripts/device/exllamav2_compare.py --out "$R" --random-dir /tmp/models/llama3-8b --ours \
  > "$R/exl_compare.txt" 2>&1
tail -4 "$R/exl_compare.txt"
echo "exllamav2 $(( $(date +%s) - t )) s"
