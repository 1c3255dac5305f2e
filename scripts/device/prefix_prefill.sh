#!/usr/bin/env bash
# Device call (issue 6, items 3-4): prefix caching TTFT and long-prompt prefill memory on the H200.
#  1. cuda tests of the blocked prefill attention and the 128k-token prefill memory check (small random model)
#  2. scripts/prefix_prefill.py on a random llama3-8b-shape 4.0 bpw model (reused from /tmp/models/llama3-8b
#     when an earlier call wrote it): TTFT of a 4096-token shared system prompt + 32 new tokens, first vs
#     second request (target >= 10x), and peak memory of a 131071-token prefill vs the planned scratch budget.
# Results: $OUT/prefix_tests.txt, $OUT/prefix_prefill.json, $OUT/prefix_prefill.txt. About 3 minutes of GPU time.
source scripts/device/common.sh
python3 -m pytest tests/kernels/test_prefill_attention.py tests/engine/test_prefill_memory.py -q -s -m cuda \
  -p no:cacheprovider 2>&1 | tee "$OUT/prefix_tests.txt" | grep -E "prefill scratch|passed|failed|error" | tail -5
MODEL=/tmp/models/llama3-8b
if [ ! -f "$MODEL/config.json" ]; then
  python3 -c "from exl2_backend.format.random_model import write_random_exl2_model as w; w('$MODEL', 'llama3-8b', bpw=4.0)" \
    || exit 1
fi
python3 scripts/prefix_prefill.py "$MODEL" --json "$OUT/prefix_prefill.json" 2>&1 | tee "$OUT/prefix_prefill.txt" | tail -4
