#!/usr/bin/env bash
# Device call I3 (session 6; carry .whl and .dev/libexl2_kernels.so.gz): where the 8B decode graph step spends its
# wall time under PDL (profile_decode.py's critical path: each kernel charged from its predecessor's end to its
# own), at 512 tokens of context (fp16) and at 32k (fp16 and q8: why q8 trails fp16 there).
export EXL2_CARRIED_LIBRARY=1
source scripts/device/common.sh
results_dir
trap '[ -d "$R" ] && pack_results i3' EXIT
t=$(date +%s)
timeout 100 python3 scripts/profile_decode.py --shapes llama3-8b --variants after --workdir /tmp/prof --no-check \
  --out "$R/p512" > "$R/profile_512.txt" 2>&1
grep -E "^######## " "$R/profile_512.txt"; grep -A12 "critical path" "$R/profile_512.txt" | head -14
echo "512: $(( $(date +%s) - t )) s"; t=$(date +%s)
timeout 150 python3 scripts/profile_decode.py --shapes llama3-8b --variants after --workdir /tmp/prof --no-check \
  --context 32768 --cache-types fp16,q8 --out "$R/p32k" > "$R/profile_32k.txt" 2>&1
grep -E "^######## " "$R/profile_32k.txt"; grep -A9 "critical path" "$R/profile_32k.txt" | head -22
echo "32k: $(( $(date +%s) - t )) s"
