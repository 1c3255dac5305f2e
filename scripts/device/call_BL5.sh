#!/usr/bin/env bash
# Device call BL5 (session 48; carry .whl and .dev; BL5_LIMIT seconds (420)): the tree as it lands. The split-K
# attention entry points' shape checks and parameters now come from one host helper (attn_host_args.h; the five
# attention units' sm_90a cubins are byte-identical, the host code is new), and `bench` times its graph step through
# bench.timing.replay_mean_ms (spec_bench ran it in BL4).
#  1. the whole GPU suite that needs no SmolLM2 (8 workers; BD24 of session 38: 2,301 passed in 83 s);
#  2. `bench` 8B 4.0 bpw at 1k and 32k, fp16 / q8 / q4 caches, and the verify step costs;
#  3. on an H200 (the targets' card; the last H200 figures are session 31's AR1), ExLlamaV2 beside ours at 1k.
export EXL2_CARRIED_LIBRARY=1
source scripts/device/common.sh
begin_card_call bl5 "${BL5_LIMIT:-420}"
whole_gpu_suite "$L"
fits 140 "bench" "$L" && { bench_8b final 130 1024,32768 fp16,q8,q4; }
fits 60 "spec costs" "$L" && spec_costs final
echo "bench $(( $(date +%s) - T0 )) s"
[ "$h200" = 1 ] && [ "$(left "$L")" -gt 90 ] && exllamav2_vs_ours "$(left "$L")"
echo "total $(( $(date +%s) - T0 )) s"
