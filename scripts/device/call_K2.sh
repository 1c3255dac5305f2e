#!/usr/bin/env bash
# Device call K2 (session 7): L2 prefetches of the tensor-core attention kernel, and fp16 pages through it
# (carry .whl and .dev/libexl2_kernels.so.gz):
#  1. the attention kernel tests (fp16 and quantized pages, both kernels each);
#  2. scripts/attention_sweep.py at 32k, fp16 through the tensor-core kernel, per EXL2_ATTN_QUANT_PREFETCH mode;
#  3. verify costs with fp16 pages through either kernel (spec_bench);
#  4. the 8B at 1k and 32k for fp16 / q8 / q4 with fp16 through the tensor-core kernel, and fp16 without.
export EXL2_CARRIED_LIBRARY=1
source scripts/device/common.sh
results_dir
trap '[ -d "$R" ] && pack_results k2' EXIT
t=$(date +%s)
gpu_tests attn 170 tests/kernels/test_kv_quant_kernels.py tests/kernels/test_paged_attention.py --timeout 120
echo "attention tests $(( $(date +%s) - t )) s"; t=$(date +%s)
for mode in 0 1 2 3 7; do
  EXL2_BACKEND_ATTN_FP16_MMA=1 EXL2_ATTN_QUANT_PREFETCH=$mode timeout 40 python3 scripts/attention_sweep.py \
    --context 32768 --types fp16,q8,q4 --ctas 3,4 --json "$R/sweep_pf$mode.json" > "$R/sweep_pf$mode.txt" 2>&1
  echo "prefetch mode $mode:"; grep "ctas/SM  4" "$R/sweep_pf$mode.txt"
done
echo "sweep $(( $(date +%s) - t )) s"; t=$(date +%s)
for mma in 0 1; do
  EXL2_BACKEND_ATTN_FP16_MMA=$mma timeout 50 python3 scripts/spec_bench.py --skip smollm2 --iters 30 \
    --work-dir /tmp/spec_bench --out "$R/spec_costs_mma$mma.json" 2> "$R/spec_costs_mma$mma.log"
  echo "fp16 mma=$mma:"; grep 'step costs' "$R/spec_costs_mma$mma.log" | tail -1
done
echo "spec $(( $(date +%s) - t )) s"; t=$(date +%s)
EXL2_BACKEND_ATTN_FP16_MMA=1 timeout 100 python3 -m exl2_backend.cli.main bench --shape llama3-8b --bpw 4.0 \
  --model-out /tmp/models/llama3-8b --contexts 1024,32768 --cache-type fp16,q8,q4 --json "$R/bench_8b.json" \
  > "$R/bench_8b.txt" 2>&1
grep -A7 "decode tokens/s by cache" "$R/bench_8b.txt" | tail -3
timeout 60 python3 -m exl2_backend.cli.main bench --shape llama3-8b --bpw 4.0 --model-out /tmp/models/llama3-8b \
  --contexts 1024,32768 --cache-type fp16 --json "$R/bench_8b_fp16_core.json" > "$R/bench_8b_fp16_core.txt" 2>&1
echo "fp16 CUDA-core kernel:"; grep -A6 "decode tokens/s by cache" "$R/bench_8b_fp16_core.txt" | tail -3
echo "bench $(( $(date +%s) - t )) s"
