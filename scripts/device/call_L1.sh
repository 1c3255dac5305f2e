#!/usr/bin/env bash
# Device call L1 (prepared in session 7 for the next one; carry .whl, .dev/libexl2_kernels.so.gz and
# .dev/gguf_part_aa, for L2 on the warm machine within 30 s):
#  1. the KV page dequantization kernel's tests (csrc/layers/kv_dequant.cu, opt-in EXL2_BACKEND_KV_DEQUANT_KERNEL=1)
#     and the rest of the quantized-cache kernel tests;
#  2. the 8B prefill over q8 / q4 caches at 1k and 32k with the kernel and without (the bench's prefill column):
#     if it wins, make it the default (ops/cuda_kvquant.KV_DEQUANT_KERNEL).
export EXL2_CARRIED_LIBRARY=1
source scripts/device/common.sh
mkdir -p /tmp/smol && cp .dev/gguf_part_a* /tmp/smol/ 2>/dev/null
results_dir
trap '[ -d "$R" ] && pack_results l1' EXIT
t=$(date +%s)
gpu_tests kvq 150 tests/kernels/test_kv_quant_kernels.py --timeout 120
echo "tests $(( $(date +%s) - t )) s"; t=$(date +%s)
for on in 0 1; do
  EXL2_BACKEND_KV_DEQUANT_KERNEL=$on timeout 100 python3 -m exl2_backend.cli.main bench --shape llama3-8b --bpw 4.0 \
    --model-out /tmp/models/llama3-8b --contexts 1024,32768 --cache-type q8,q4 --json "$R/bench_8b_dq$on.json" \
    > "$R/bench_8b_dq$on.txt" 2>&1
  echo "dequant kernel=$on:"; grep -E "^│ +(1024|32768) │" "$R/bench_8b_dq$on.txt"
done
echo "bench $(( $(date +%s) - t )) s"
