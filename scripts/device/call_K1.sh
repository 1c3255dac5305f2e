#!/usr/bin/env bash
# Device call K1 (session 7): the tensor-core attention kernel over quantized pages
# (csrc/layers/paged_attention_quant_mma.cu; carry .whl and .dev/libexl2_kernels.so.gz):
#  1. the quantized-cache kernel tests (both kernels), then the rest of the GPU tests without SmolLM2;
#  2. scripts/attention_sweep.py at 32k for every cache type, tensor-core kernel against the CUDA-core one;
#  3. the 8B at 1k and 32k for fp16 / q8 / q4, and at 32k with the CUDA-core kernel (same call);
#  4. the q8 critical path at 32k.
export EXL2_CARRIED_LIBRARY=1
source scripts/device/common.sh
results_dir
trap '[ -d "$R" ] && pack_results k1' EXIT
t=$(date +%s)
gpu_tests kvq 150 tests/kernels/test_kv_quant_kernels.py --timeout 120
echo "kv tests $(( $(date +%s) - t )) s"; t=$(date +%s)
for mma in 1 0; do
  EXL2_BACKEND_ATTN_QUANT_MMA=$mma timeout 60 python3 scripts/attention_sweep.py --context 32768 \
    --types fp16,fp8,q8,q6,q4 --ctas 2,3,4,6,8 --json "$R/sweep_mma$mma.json" > "$R/sweep_mma$mma.txt" 2>&1
  echo "sweep mma=$mma:"; tail -8 "$R/sweep_mma$mma.txt"
done
echo "sweep $(( $(date +%s) - t )) s"; t=$(date +%s)
timeout 100 python3 -m exl2_backend.cli.main bench --shape llama3-8b --bpw 4.0 --model-out /tmp/models/llama3-8b \
  --contexts 1024,32768 --cache-type fp16,q8,q4 --json "$R/bench_8b.json" > "$R/bench_8b.txt" 2>&1
grep -A7 "decode tokens/s by cache" "$R/bench_8b.txt" | tail -3
EXL2_BACKEND_ATTN_QUANT_MMA=0 timeout 80 python3 -m exl2_backend.cli.main bench --shape llama3-8b --bpw 4.0 \
  --model-out /tmp/models/llama3-8b --contexts 32768 --cache-type fp16,q8,q4 --json "$R/bench_8b_core.json" \
  > "$R/bench_8b_core.txt" 2>&1
echo "CUDA-core kernel:"; grep -A6 "decode tokens/s by cache" "$R/bench_8b_core.txt" | tail -2
echo "bench $(( $(date +%s) - t )) s"; t=$(date +%s)
timeout 60 python3 scripts/profile_decode.py --shapes llama3-8b --variants after --workdir /tmp/prof --no-check \
  --context 32768 --cache-types q8,q4 --out "$R/p32k" > "$R/profile_32k.txt" 2>&1
grep -E "^######## " "$R/profile_32k.txt"; grep -A6 "critical path" "$R/profile_32k.txt" | grep -E "attention|reduce|kv_quant|gemv"
echo "profile $(( $(date +%s) - t )) s"; t=$(date +%s)
gpu_tests tests 200 $CUDA_TESTS_NO_SMOLLM2 --timeout 120 --ignore=tests/kernels/test_kv_quant_kernels.py
echo "tests $(( $(date +%s) - t )) s"
