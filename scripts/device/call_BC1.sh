#!/usr/bin/env bash
# Device call BC1 (session 36; carry .whl (with exllamav2 0.3.2) and .dev/libexl2_kernels.so.gz; ~560 s). The
# library is session 35's (csrc/ == 603a2b9, C ABI 13). Measurements only:
#  1. Session 35's BB1 (its call script folded in here): ncu --set full of the GEMV at M = 1 and M = 5 for down
#     (14336 x 4096, 8/4-bit mix), gate/up (4096 x 14336, 4-bit) and q/o (4096 x 4096): where a k = 4 verify's
#     GEMVs grow with M (+215 us over the decode step's 2,027 on the H100), stalls by code region
#     (scripts/ncu_stalls.py).
#  2. The flaky lookahead logprobs test: each mode three times (scripts/device/debug_lookahead_logprobs.py):
#     does either mode repeat itself, and how far apart are they.
#  3. Verify / decode step costs with the streamed attention's shortest split at 16 (default), 32 and 64 keys
#     (the verify's reduce combines 5x the rows of a decode step's: 192 against 122 us, AZ1).
#  4. ExLlamaV2 0.3.2 reads the random 8B written by the centred-code writer (session 35): its logits against ours
#     on random ids (exllamav2_compare.py --compat-only --random-ids).
export EXL2_CARRIED_LIBRARY=1
source scripts/device/common.sh
begin_call bc1
start_exllamav2_jit
(python3 -c "
from exl2_backend.format.random_model import write_random_exl2_model
write_random_exl2_model('/tmp/models/llama3-8b', 'llama3-8b', 4.0, workers=8)" > "$R/write_8b.txt" 2>&1) &
W8=$!
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader
L=${BC1_LIMIT:-560}
for shape in 2 0 3; do
  for m in 1 5; do
    name="gemv_s${shape}_m$m"
    fits 45 "ncu $name" "$L" || continue
    timeout 45 ncu --clock-control none --set full --import-source no -k "regex:gemv_tma" --launch-skip 2 \
      --launch-count 1 -o "$R/$name" python3 scripts/bench_gemm.py --one --shape "$shape" --m "$m" \
      > "$R/$name.log" 2>&1
    ncu_export "$name"
    echo "== $name"
    grep -E "^    Duration|DRAM Throughput|Issue Slots Busy|Eligible Warps|Registers Per|Achieved Occupancy" \
      "$R/$name.details.txt" | head -6
    python3 scripts/ncu_stalls.py "$R/$name.sass.csv.gz" --top 8 --bucket 150 > "$R/$name.stalls.txt" 2>&1
    head -14 "$R/$name.stalls.txt" | cut -c1-150
  done
done
echo "elapsed $(( $(date +%s) - T0 )) s"
fits 60 "lookahead logprobs" "$L" && { timeout 60 python3 scripts/device/debug_lookahead_logprobs.py \
  > "$R/lookahead_logprobs.txt" 2>&1; tail -12 "$R/lookahead_logprobs.txt" | cut -c1-300; }
echo "elapsed $(( $(date +%s) - T0 )) s"
for s in 16 64 32; do
  fits 60 "spec min split $s" "$L" && spec_costs "split$s" EXL2_BACKEND_ATTN_STREAM_MIN_SPLIT=$s
done
echo "elapsed $(( $(date +%s) - T0 )) s"
if fits 100 "exllamav2 compat" "$L"; then
  wait $JIT $W8; tail -1 "$OUT/exl_jit.txt"
  timeout "$(left "$((L - 5))")" python3 scripts/device/exllamav2_compare.py --out "$R" \
    --compat-only /tmp/models/llama3-8b --random-ids > "$R/compat_8b.txt" 2>&1
  tail -6 "$R/compat_8b.txt" | cut -c1-300
fi
echo "total $(( $(date +%s) - T0 )) s"
