#!/usr/bin/env bash
# Device call BC7 (session 36; carry .whl and .dev/libexl2_kernels.so.gz; ~130 s): the streamed code-page attention
# on tensor cores with its query loads all in flight (BC6's ncu: the one-after-another loads held ~23% of the stall
# samples): its tests, the 32k attention alone with and without it, bench at 32k with it.
export EXL2_CARRIED_LIBRARY=1
source scripts/device/common.sh
begin_call bc7
L=${BC7_LIMIT:-200}
gpu_tests stream 60 -n 8 tests/kernels/test_paged_attention_stream.py -k "code_pages"
for v in 1 0; do
  fits 30 "sweep $v" "$L" && { EXL2_BACKEND_ATTN_STREAM_QUANT=$v timeout 30 python3 scripts/attention_sweep.py \
    --context 32768 --types q8,q4 --splits 0 --json "$R/sweep_32768_$v.json" > "$R/sweep_32768_$v.txt" 2>&1
    echo "== sweep 32768 stream_quant=$v"; grep -E "q8|q4|Error" "$R/sweep_32768_$v.txt" | head -4; }
done
fits 80 "bench quant on" "$L" && bench_8b qon 80 1024,32768 q8,q4 EXL2_BACKEND_ATTN_STREAM_QUANT=1
echo "total $(( $(date +%s) - T0 )) s"
