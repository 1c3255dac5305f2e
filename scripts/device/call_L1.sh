#!/usr/bin/env bash
# Device call L1 (prepared in session 7 for the next one; carry .whl, .dev/libexl2_kernels.so.gz and
# .dev/gguf_part_aa, for L2 on the warm machine within 30 s):
#  1. the KV page dequantization kernel's tests (csrc/layers/kv_dequant.cu, opt-in EXL2_BACKEND_KV_DEQUANT_KERNEL=1)
#     and the rest of the quantized-cache kernel tests;
#  2. the 8B prefill over q8 / q4 caches at 1k and 32k with the kernel and without (the bench's prefill column):
#     if it wins, make it the default (ops/cuda_kvquant.KV_DEQUANT_KERNEL);
#  3. the tensor-core attention kernel's deeper variant (EXL2_ATTN_QUANT_MMA_DEEP=1, 3 CTAs per SM) in one wave at
#     last (attention_splits now rounds down: 49 splits at 3 per SM), against the default at 3 and 4; its one-pass
#     variants (EXL2_BACKEND_ATTN_MMA_ONLINE=1 / 2: online softmax, 3 / 2 CTAs per SM), fp16 pages included (their
#     tests run in 1. through the attn_kernel fixtures);
#  4. the pytest-benchmark cases of the quantized-page attention.
export EXL2_CARRIED_LIBRARY=1
source scripts/device/common.sh
mkdir -p /tmp/smol && cp .dev/gguf_part_a* /tmp/smol/ 2>/dev/null
results_dir
trap '[ -d "$R" ] && pack_results l1' EXIT
t=$(date +%s)
gpu_tests attn 200 tests/kernels/test_kv_quant_kernels.py tests/kernels/test_paged_attention.py --timeout 120
echo "tests $(( $(date +%s) - t )) s"; t=$(date +%s)
for on in 0 1; do
  EXL2_BACKEND_KV_DEQUANT_KERNEL=$on timeout 100 python3 -m exl2_backend.cli.main bench --shape llama3-8b --bpw 4.0 \
    --model-out /tmp/models/llama3-8b --contexts 1024,32768 --cache-type q8,q4 --json "$R/bench_8b_dq$on.json" \
    > "$R/bench_8b_dq$on.txt" 2>&1
  echo "dequant kernel=$on:"; grep -E "^│ +(1024|32768) │" "$R/bench_8b_dq$on.txt"
done
echo "bench $(( $(date +%s) - t )) s"
t=$(date +%s)
for deep in 0 1; do
  EXL2_ATTN_QUANT_MMA_DEEP=$deep timeout 30 python3 scripts/attention_sweep.py --context 32768 --types q8,q4 \
    --ctas 3,4 --json "$R/sweep_deep$deep.json" > "$R/sweep_deep$deep.txt" 2>&1
  echo "deep=$deep:"; grep "ctas/SM" "$R/sweep_deep$deep.txt"
done
for online in 1 2; do
  EXL2_BACKEND_ATTN_MMA_ONLINE=$online EXL2_BACKEND_ATTN_FP16_MMA=1 timeout 30 python3 scripts/attention_sweep.py \
    --context 32768 --types fp16,q8,q4 --ctas 2,3,4 --json "$R/sweep_online$online.json" \
    > "$R/sweep_online$online.txt" 2>&1
  echo "one pass, variant $online:"; grep "ctas/SM" "$R/sweep_online$online.txt"
done
echo "sweep $(( $(date +%s) - t )) s"
t=$(date +%s)
timeout 50 python3 -m pytest tests/bench/test_bench_layers.py -k "quant" -q -m cuda -p no:cacheprovider \
  --benchmark-enable --benchmark-columns=median,iqr,rounds 2>&1 | tee "$R/bench_layers_quant.txt" | tail -14
echo "pytest-benchmark $(( $(date +%s) - t )) s"
