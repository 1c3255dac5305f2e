#!/usr/bin/env bash
# Device call AK3 (session 22; ~540 s). Carry .whl and .dev/libexl2_kernels.so.gz built from the commit that runs
# (bash scripts/build_variant.sh "" .dev/libexl2_kernels.so.gz).
#  1. The decode attention at 1k with fewer, longer splits (EXL2_BACKEND_ATTN_MIN_SPLIT=128 / 256 keys: 8 / 4
#     splits and a shorter reduce, against 16 splits of 64): spec_bench interleaved twice.
#  2. The session's figures: `bench` at 1k and 32k (fp16 / q8 / q4), then ExLlamaV2 0.3.2 beside ours on the same
#     random 8B directory, at 1k (fp16) and at 32k (fp16, q4) as time allows.
export EXL2_CARRIED_LIBRARY=1
source scripts/device/common.sh
begin_call ak3
start_exllamav2_jit
interleaved_spec_costs D S128_=EXL2_BACKEND_ATTN_MIN_SPLIT=128 S256_=EXL2_BACKEND_ATTN_MIN_SPLIT=256
echo "elapsed $(( $(date +%s) - T0 )) s"
bench_8b final 130 1024,32768 fp16,q8,q4
grep -E "^prefill|read bandwidth" "$R/bench_final.txt" | head -4
echo "elapsed $(( $(date +%s) - T0 )) s"
exllamav2_vs_ours "$(left 330)"
mv "$R/exl_compare.txt" "$R/exl_compare_1k.txt"; mv "$R/exllamav2_compare.json" "$R/exllamav2_compare_1k.json"
echo "elapsed $(( $(date +%s) - T0 )) s"
exllamav2_vs_ours "$(left 530)" --context 32768 --cache-types fp16,q4 --decode-tokens 64
echo "total $(( $(date +%s) - T0 )) s"
