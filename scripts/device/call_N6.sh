#!/usr/bin/env bash
# Device call N6 (session 9; carry .whl (with exllamav2 0.3.2), .dev/libexl2_kernels.so.gz and .dev/libold.so.gz,
# the library before this session's kernel changes). After N5 (the fused norm's loads in flight: 8B step 2.874 ->
# 2.746 ms), the same fix in rope_kv_write (q / k / v loads behind the previous item's stores, the cos/sin table
# built before any of them was issued) and in the quantizing KV write (slot, k, v and q loads behind the q stores).
#  1. the GPU tests of the layer kernels (rope, norm), the quantized KV write and the fused-norm GEMV;
#  2. this session's changes against the library before them, in one call: bench (8B, 1k / 32k, fp16 / q8 / q4;
#     the old library at 1k fp16 and 32k q8), verify costs (spec_bench);
#  3. ExLlamaV2 0.3.2 on the same random 8B directory at 1k, with ours (exllamav2_compare --ours).
export EXL2_CARRIED_LIBRARY=1
source scripts/device/common.sh
results_dir
trap '[ -d "$R" ] && pack_results n6' EXIT
gunzip -c .dev/libold.so.gz > /tmp/libold.so
OLD=/tmp/libold.so
start_exllamav2_jit
t=$(date +%s)
gpu_tests kernels 100 tests/kernels/test_layers.py tests/kernels/test_kv_quant_kernels.py \
  tests/kernels/test_gemv_norm.py --timeout 80
echo "tests $(( $(date +%s) - t )) s"; t=$(date +%s)
bench_8b new 110 1024,32768 fp16,q8,q4
bench_8b old_fp16 110 1024 fp16 EXL2_BACKEND_LIBRARY=$OLD
bench_8b old_q8 110 32768 q8 EXL2_BACKEND_LIBRARY=$OLD
echo "bench $(( $(date +%s) - t )) s"; t=$(date +%s)
spec_costs new
spec_costs old EXL2_BACKEND_LIBRARY=$OLD
echo "spec $(( $(date +%s) - t )) s"; t=$(date +%s)
wait $JIT; tail -1 "$OUT/exl_jit.txt"; cp "$OUT/exl_jit.txt" "$R/" 2>/dev/null; rm -f "$OUT/exl_jit.txt"
timeout 170 python3 scripts/device/exllamav2_compare.py --out "$R" --random-dir /tmp/models/llama3-8b --ours \
  --skip-compat > "$R/exl_compare.txt" 2>&1
grep -E "exllamav2 no_sdpa|ours:" "$R/exl_compare.txt" | cut -c1-220; tail -3 "$R/exl_compare.txt" | cut -c1-300
echo "exllamav2 $(( $(date +%s) - t )) s"
