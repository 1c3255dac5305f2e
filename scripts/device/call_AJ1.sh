#!/usr/bin/env bash
# Device call AJ1 (prepared in session 20, not yet run; carry .whl and .dev/libexl2_kernels.so.gz; ~120 s): where a
# 2k prefill of the 8B spends the 27-34% it loses with q8 and q4 caches against fp16 (AI5: 34,668 / 25,239 / 22,742
# tok/s, medians of three in one process). scripts/profile_prefill.py, one model, one engine per cache type, the
# kernels of one profiled prefill by self time.
export EXL2_CARRIED_LIBRARY=1
source scripts/device/common.sh
begin_call aj1
timeout 150 python3 scripts/profile_prefill.py --shape llama3-8b --workdir /tmp/models --cache-types fp16,q8,q4 \
  --top 20 --json "$R/profile_prefill.json" > "$R/profile_prefill.txt" 2>&1
grep -E "^== |^ +[0-9]" "$R/profile_prefill.txt" | cut -c1-160
echo "total $(( $(date +%s) - T0 )) s"
