#!/usr/bin/env bash
# RAN in session 49 (H100; docs/performance.md, session 49).
# Device call BM1 (session 49; carry .whl and .dev; BM1_LIMIT seconds (480)): the tree as it lands. The two
# paged-attention ops share their argument checks and q/tables/lens preparation (a q off a 16-byte boundary is now
# copied for code pages too; new GPU tests of both), and bench.timing.graph_time_us times each replay through
# replay_mean_ms (the roofline's bandwidth and tests/bench use it). The csrc is unchanged (hash as BL5's).
#  1. the whole GPU suite that needs no SmolLM2 (8 workers; BL5: 2,334 passed in 79 s);
#  2. the 8B decode step at 1k, fp16 cache, with its critical path kernel by kernel and by GEMV role
#     (profile_decode; where the time goes against issue 3's 80%);
#  3. `bench` 8B 4.0 bpw at 1k and 32k, fp16 / q8 / q4 caches, and the verify step costs;
#  4. on an H200, ExLlamaV2 beside ours at 1k.
export EXL2_CARRIED_LIBRARY=1
source scripts/device/common.sh
begin_card_call bm1 "${BM1_LIMIT:-480}"
whole_gpu_suite "$L"
if fits 90 "decode step" "$L"; then
  decode_step_1k final nochain
  grep -A22 "critical path (per step" "$R/prof_final.txt" | head -24 | cut -c1-120
  grep -A8 "GEMVs by role on the critical path" "$R/prof_final.txt" | cut -c1-120
fi
echo "profile $(( $(date +%s) - T0 )) s"
fits 140 "bench" "$L" && bench_8b final 130 1024,32768 fp16,q8,q4
fits 60 "spec costs" "$L" && spec_costs final
echo "bench $(( $(date +%s) - T0 )) s"
[ "$h200" = 1 ] && [ "$(left "$L")" -gt 90 ] && exllamav2_vs_ours "$(left "$L")"
echo "total $(( $(date +%s) - T0 )) s"
