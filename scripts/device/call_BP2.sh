#!/usr/bin/env bash
# RAN in session 52 (H100, 243 s): suite 2,374 passed; decode O 2.279 / 2.287 ms, D 2.304 / 2.290; k = 4 verify O
# 2.848 / 2.829, D 2.847 / 2.830: no gain, the code (84f541d) is reverted again. Running it needs that commit's csrc.
# Device call BP2 (session 52; carry .whl and .dev: this csrc's library (D: session 50's vector copy of in-order
# GEMV inputs, only where the two-byte items would take more than one round of loads, restored) and session 48's
# (O, .dev/libO.so.gz); BP2_LIMIT seconds (540)). BN6 with the whole suite and the closing figures:
#  1. the whole GPU suite that needs no SmolLM2 (its in-order test: vectors bit-identical to the pre-gathered input
#     at 1-16 tokens, gated or not);
#  2. spec_bench step costs, O and D interleaved twice (BN5, vectors everywhere: decode 2.337 / 2.314 ms against
#     O's 2.280 / 2.301, the k = 4 verify 0.5% faster), then D by role (spec_bench --kernels);
#  3. the closing figures (bench 1k / 32k, fp16 / q8 / q4; ExLlamaV2 beside ours on an H200) if time is left.
export EXL2_CARRIED_LIBRARY=1
source scripts/device/common.sh
begin_card_call bp2 "${BP2_LIMIT:-540}"
use_libraries O=.dev/libO.so.gz
suite_and_o_d_steps 50
fits 70 Dk "$L" && SPEC_KERNELS=1 spec_costs Dk
if fits 140 bench "$L"; then
  bench_8b final 130 1024,32768 fp16,q8,q4
  [ "$h200" = 1 ] && fits 100 exllamav2 "$L" && exllamav2_vs_ours "$(( $(left "$L") - 10 ))"
fi
echo "total $(( $(date +%s) - T0 )) s"
