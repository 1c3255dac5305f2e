#!/usr/bin/env bash
# Device call M1 (session 8): the persistent GEMV chain (csrc/quant/exl2_gemv_chain.cu; o -> gate/up -> down ->
# next q/k/v in one launch, norm and pregather phases from M = 3) and the TMA GEMV split into shared steps
# (exl2_gemv_tma.cuh); carry .whl and .dev/libexl2_kernels.so.gz. Lean: failed machine starts ate the device time.
#  1. the chain's tests, the norm-fused GEMV's, and the GEMV tests of test_exl2_gemm.py;
#  2. the 8B decode step with and without the chain (profile_decode: graph step, critical path, greedy check);
#  3. the 8B bench at 1k and 32k for fp16 / q8 / q4 with the chain;
#  4. the verify step costs (spec_bench: k = 1 / 2 / 4 / 8 against a decode step).
export EXL2_CARRIED_LIBRARY=1
source scripts/device/common.sh
results_dir
trap '[ -d "$R" ] && pack_results m1' EXIT
t=$(date +%s)
gpu_tests chain 130 tests/kernels/test_gemv_chain.py tests/kernels/test_gemv_norm.py tests/kernels/test_exl2_gemm.py \
  -k "chain or norm or gemv or pregathered or vec4 or pdl" --timeout 100
echo "tests $(( $(date +%s) - t )) s"; t=$(date +%s)
timeout 80 python3 scripts/profile_decode.py --shapes llama3-8b --variants after,nochain --workdir /tmp/prof \
  --context 1024 --cache-types fp16 --out "$R/p1k" > "$R/profile_1k.txt" 2>&1
grep -E "^######## |graph step|greedy|!!|exact" "$R/profile_1k.txt" | head -12
grep -A12 "critical path" "$R/profile_1k.txt" | head -40
echo "profile $(( $(date +%s) - t )) s"; t=$(date +%s)
timeout 110 python3 -m exl2_backend.cli.main bench --shape llama3-8b --bpw 4.0 --model-out /tmp/models/llama3-8b \
  --contexts 1024,32768 --cache-type fp16,q8,q4 --json "$R/bench_8b.json" --plot "$R/bench_8b.png" \
  > "$R/bench_8b.txt" 2>&1
grep -A7 "decode tokens/s by cache" "$R/bench_8b.txt" | tail -3
echo "bench 8b $(( $(date +%s) - t )) s"; t=$(date +%s)
timeout 50 python3 scripts/spec_bench.py --skip smollm2 --iters 30 --work-dir /tmp/spec_bench \
  --out "$R/spec_costs.json" 2> "$R/spec_costs.log"
grep 'step costs' "$R/spec_costs.log" | tail -1
echo "spec $(( $(date +%s) - t )) s"
