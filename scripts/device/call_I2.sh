#!/usr/bin/env bash
# Device call I2 (session 6; carry .whl and .dev/libexl2_kernels.so.gz): I1 ran the GPU tests beside ExLlamaV2's
# JIT build and they hit their time limit, and it showed the fused norm losing at three passes (M = 5). Here,
# with the norm fused only where M fits one pass:
#  1. the GPU tests without SmolLM2, alone (the norm-fused GEMV tests included);
#  2. the 8B decode step with the norm fused (after) and apart (nonorm), and the greedy bit-identity check;
#  3. verify costs (spec_bench), bench_gemm --m1, the 8B at 1k and 32k for fp16 / q8 / q4, the 70B at 1k and 8k.
export EXL2_CARRIED_LIBRARY=1
source scripts/device/common.sh
results_dir
trap '[ -d "$R" ] && pack_results i2' EXIT
t=$(date +%s)
gpu_tests tests 280 $CUDA_TESTS_NO_SMOLLM2 --timeout 120
echo "tests $(( $(date +%s) - t )) s"; t=$(date +%s)
timeout 120 python3 scripts/profile_decode.py --shapes llama3-8b --variants after,nonorm --workdir /tmp/prof \
  --out "$R" > "$R/profile.txt" 2>&1
grep -E "^######## |graph before/after" "$R/profile.txt" | sed 's/.*\/ //'
echo "profile $(( $(date +%s) - t )) s"; t=$(date +%s)
timeout 50 python3 scripts/spec_bench.py --skip smollm2 --iters 30 --work-dir /tmp/spec_bench \
  --out "$R/spec_costs.json" 2> "$R/spec_costs.log"
grep 'step costs' "$R/spec_costs.log" | tail -1
timeout 40 python3 scripts/bench_gemm.py --m1 > "$R/m1.txt" 2>&1; grep M1 "$R/m1.txt" | head -6
timeout 110 python3 -m exl2_backend.cli.main bench --shape llama3-8b --bpw 4.0 --model-out /tmp/models/llama3-8b \
  --contexts 1024,32768 --cache-type fp16,q8,q4 --json "$R/bench_8b.json" --plot "$R/bench_8b.png" > "$R/bench_8b.txt" 2>&1
grep -A6 "decode tokens/s by cache" "$R/bench_8b.txt" | tail -3
echo "bench 8B $(( $(date +%s) - t )) s"; t=$(date +%s)
rm -rf /tmp/models/llama3-8b /tmp/spec_bench /tmp/prof
timeout 150 python3 -m exl2_backend.cli.main bench --shape llama3-70b --bpw 4.0 --model-out /tmp/models/llama3-70b \
  --contexts 1024,8192 --json "$R/bench_70b.json" > "$R/bench_70b.txt" 2>&1
grep -B1 -A6 "decode" "$R/bench_70b.txt" | grep -E "│ +[0-9]" | head -3
echo "bench 70B $(( $(date +%s) - t )) s"
