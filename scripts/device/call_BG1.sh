#!/usr/bin/env bash
# Device call BG1 (prepared in session 40 for the next closing figures; carry .whl (with exllamav2 0.3.2, ninja)
# and .dev; ~480 s): call_BA1.sh's closing figures with ExLlamaV2's JIT build started after `bench`, not before:
# BF4 (session 40) measured bench's 2k prefill at 24,228 tok/s for the fp16 cache while the build ran on the host's
# cores (29,272 / 28,748 for q8 / q4 after it, 30,578 in the ExLlamaV2 comparison that followed; session 39 31,122).
#  1. The streamed kernels' routing tests.
#  2. bench 1k / 32k (fp16 / q8 / q4) with nothing else on the host; then the JIT build starts.
#  3. Verify costs; the GEMV benchmarks at M = 1 and 5 against the read bandwidth (GPU-bound graph replays).
#  4. ExLlamaV2 0.3.2 beside ours at 32k (fp16, q4: issue 6's 10x), then at 1k (issue 3's 5x) as time allows.
export EXL2_CARRIED_LIBRARY=1
source scripts/device/common.sh
begin_call bg1
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader
L=${BG1_LIMIT:-570}
gpu_tests stream 40 -n 8 tests/kernels/test_paged_attention_stream.py
bench_8b final 130 1024,32768 fp16,q8,q4
grep -E "^prefill|read bandwidth" "$R/bench_final.txt" | head -3
echo "elapsed $(( $(date +%s) - T0 )) s"
start_exllamav2_jit
fits 60 "spec costs" "$L" && spec_costs final
fits 80 "gemv benchmarks" "$L" && { bench_suite gemv 70 -k fused_gemv --benchmark-json="$R/gemv.json"
  python3 -c "
import json, sys
for b in json.load(open(sys.argv[1]))['benchmarks']:
    e = b['extra_info']; print(b['name'], round(e['us_per_kernel'], 2), 'us', round(e['gb_per_s']), 'GB/s')" \
    "$R/gemv.json" 2>&1 | tail -12; }
echo "elapsed $(( $(date +%s) - T0 )) s"
fits 110 "exllamav2 32k" "$L" && exllamav2_vs_ours "$(left "$((L - 100))")" --context 32768 --cache-types fp16,q4 \
  --decode-tokens 64
[ -f "$R/exl_compare.txt" ] && { mv "$R/exl_compare.txt" "$R/exl_compare_32k.txt"
  mv "$R/exllamav2_compare.json" "$R/exllamav2_compare_32k.json" 2>/dev/null; }
fits 80 "exllamav2 1k" "$L" && exllamav2_vs_ours "$(left "$L")"
echo "total $(( $(date +%s) - T0 )) s"
