#!/usr/bin/env bash
# RAN in session 50 (H100): GPU suite 2,337 passed; the 1k step 2.250 ms over its real context; 16 keys stay.
# Device call BN3 (session 50; carry .whl and .dev, csrc faef46bdd949, no build; BN3_LIMIT seconds (480)):
#  1. the whole GPU suite without SmolLM2 (the two paged-attention ops now ask one shared check which inputs their
#     kernels take, bfc293c);
#  2. the 8B decode step at 1k over its real context: profile_decode replayed the plain graph, whose inputs greedy
#     steps (graph I/O) never write, so every profile since session 27 timed a step over an empty context (BM1:
#     attention and reduce 68 us of a 2,122 us step; spec_bench's decode graph, uploaded, BN1: 266 of 2,295). Now
#     uploaded (upload_decode_step): the corrected critical path, and the streamed attention's shortest split at
#     16 (default), 32 and 64 keys (EXL2_BACKEND_ATTN_STREAM_MIN_SPLIT), whose choice (session 35) may have rested
#     on the empty context too.
export EXL2_CARRIED_LIBRARY=1
source scripts/device/common.sh
begin_card_call bn3 "${BN3_LIMIT:-480}"
whole_gpu_suite "$L"
for v in S16 S32 S64 S16b; do
  fits 90 "decode step $v" "$L" || continue
  keys=${v:1:2}
  decode_step_1k "$v" nochain EXL2_BACKEND_ATTN_STREAM_MIN_SPLIT="$keys"
  attention_paths "$v"
done
grep -A22 "critical path (per step" "$R/prof_S16.txt" | head -24 | cut -c1-120
grep -A8 "GEMVs by role on the critical path" "$R/prof_S16.txt" | cut -c1-120
echo "total $(( $(date +%s) - T0 )) s"
