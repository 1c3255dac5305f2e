#!/usr/bin/env bash
# Device call AF3 (session 17; carry .whl and .dev/libexl2_kernels.so.gz; the last ~330 s of the session's budget):
#  1. the critical path of the k = 4 verify graph beside the decode graph, kernel by kernel (spec_bench --kernels),
#     now that a verify's row tiles share rings (AF2: k = 4 1.261 / 1.263 of a decode step);
#  2. ExLlamaV2 0.3.2 beside ours on the random 70B directory at 1k (issue 3 asks >= 2.5x; AF2 had ours at 63.9
#     tok/s, 53.9% of the roofline), while it JIT-builds the 70B directory is written (AF2: 28 s).
export EXL2_CARRIED_LIBRARY=1
source scripts/device/common.sh
begin_call af3
start_exllamav2_jit
write_70b_background
timeout 100 python3 scripts/spec_bench.py --skip smollm2 --iters 30 --kernels --work-dir /tmp/spec_bench \
  --out "$R/spec_kernels.json" > "$R/spec_kernels.txt" 2>&1
echo "== spec kernels: $(grep 'step costs' "$R/spec_kernels.txt" | tail -1 | cut -c1-200)"
grep -iE "critical|TOTAL" "$R/spec_kernels.txt" | head -12
wait $W70; tail -1 "$R/write_70b.txt"
wait $JIT; tail -1 "$OUT/exl_jit.txt"; cp "$OUT/exl_jit.txt" "$R/" 2>/dev/null
echo "elapsed $(( $(date +%s) - T0 )) s"
timeout "$(left 320)" python3 scripts/device/exllamav2_compare.py --out "$R" --random-dir /tmp/models/llama3-70b \
  --ours --skip-compat --context 1024 --decode-tokens 32 --prefill-tokens 512 > "$R/exl_compare_70b.txt" 2>&1
grep -E "exllamav2 no_sdpa|ours:" "$R/exl_compare_70b.txt" | cut -c1-220; tail -3 "$R/exl_compare_70b.txt" | cut -c1-300
echo "total $(( $(date +%s) - T0 )) s"
