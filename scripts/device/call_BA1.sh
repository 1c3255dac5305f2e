#!/usr/bin/env bash
# Device call BA1 (session 35; carry .whl (with exllamav2 0.3.2, ninja) and .dev/libexl2_kernels.so.gz; ~570 s;
# meant for an H200, the card issue 3's and 6's targets name). The library is session 33's final one again (the
# norm handoff lost twice on the H100, AZ3 and AZ1, and is gone: csrc/ equals 603a2b9, C ABI 13), with verify
# attention on the tensor-core streamed kernel by default (AY1).
#  1. The streamed kernels' routing test that AZ1 found stale (verify rows are its shapes now).
#  2. The closing figures: bench 1k / 32k (fp16 / q8 / q4), the GEMV at M = 1 and 5 against the read bandwidth
#     (tests/bench, pytest-benchmark), verify costs.
#  3. ExLlamaV2 0.3.2 beside ours at 32k (fp16, q4: issue 6's 10x), then at 1k (issue 3's 5x) as time allows.
export EXL2_CARRIED_LIBRARY=1
source scripts/device/common.sh
begin_call ba1
start_exllamav2_jit
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader
L=${BA1_LIMIT:-570}
gpu_tests stream 40 -n 8 tests/kernels/test_paged_attention_stream.py
echo "elapsed $(( $(date +%s) - T0 )) s"
bench_8b final 130 1024,32768 fp16,q8,q4
grep -E "^prefill|read bandwidth" "$R/bench_final.txt" | head -3
echo "elapsed $(( $(date +%s) - T0 )) s"
fits 60 "spec costs" "$L" && spec_costs final
fits 110 "exllamav2 32k" "$L" && exllamav2_vs_ours "$(left "$((L - 150))")" --context 32768 --cache-types fp16,q4 \
  --decode-tokens 64
[ -f "$R/exl_compare.txt" ] && { mv "$R/exl_compare.txt" "$R/exl_compare_32k.txt"
  mv "$R/exllamav2_compare.json" "$R/exllamav2_compare_32k.json" 2>/dev/null; }
echo "elapsed $(( $(date +%s) - T0 )) s"
fits 80 "gemv benchmarks" "$L" && { bench_suite gemv 70 -k fused_gemv --benchmark-json="$R/gemv.json"
  python3 -c "
import json, sys
for b in json.load(open(sys.argv[1]))['benchmarks']:
    e = b['extra_info']; print(b['name'], round(e['us_per_kernel'], 2), 'us', round(e['gb_per_s']), 'GB/s')" \
    "$R/gemv.json" 2>&1 | tail -12; }
fits 80 "exllamav2 1k" "$L" && exllamav2_vs_ours "$(left "$L")"
echo "total $(( $(date +%s) - T0 )) s"
