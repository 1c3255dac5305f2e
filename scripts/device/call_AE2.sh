#!/usr/bin/env bash
# Device call AE2 (prepared in session 16, not yet run; carry .whl and .dev/libexl2_kernels.so.gz; ~500 s): issue 3's
# other shapes, last measured in session 6 (70B 57.7 tok/s at 1k, 48.6% of the roofline; 1B 989.2, 17.2%), and
# ExLlamaV2 on the 70B shape (issue 3 asks >= 2.5x there). The 70B's random directory (~40 GB) takes minutes to
# write (session 5's call ran out of time writing it), so it is written in the background from the start while the
# 1B shape runs, ncu looks at the staged attention (EXL2_ATTN_STAGED=2) at 32k and ExLlamaV2 JIT-builds.
export EXL2_CARRIED_LIBRARY=1
source scripts/device/common.sh
begin_call ae2
start_exllamav2_jit
(t0=$(date +%s); python3 -c "
from exl2_backend.format.random_model import write_random_exl2_model
write_random_exl2_model('/tmp/models/llama3-70b', 'llama3-70b', 4.0, workers=12)" > "$R/write_70b.txt" 2>&1
 echo "70B written (rc=$?) in $(( $(date +%s) - t0 )) s" >> "$R/write_70b.txt") &
W70=$!
timeout 120 python3 -m exl2_backend.cli.main bench --shape llama3-1b --bpw 4.0 --model-out /tmp/models/llama3-1b \
  --contexts 1024,8192 --cache-type fp16 --json "$R/bench_1b.json" > "$R/bench_1b.txt" 2>&1
echo "== 1B"; grep -E "^│ +[0-9]+ │" "$R/bench_1b.txt"
# While the 70B is written: ncu of the staged attention at 32k (what bounds it now; AC1 had the register kernel's).
ncu_attention ncu_staged_fp16 fp16 EXL2_ATTN_STAGED=2
ncu_attention ncu_staged_q4 q4 EXL2_ATTN_STAGED=2
wait $W70; tail -1 "$R/write_70b.txt"
echo "elapsed $(( $(date +%s) - T0 )) s"
timeout 150 python3 -m exl2_backend.cli.main bench /tmp/models/llama3-70b --contexts 1024,8192 --cache-type fp16 \
  --json "$R/bench_70b.json" > "$R/bench_70b.txt" 2>&1
echo "== 70B"; grep -E "^│ +[0-9]+ │" "$R/bench_70b.txt"; tail -2 "$R/bench_70b.txt" | cut -c1-200
echo "elapsed $(( $(date +%s) - T0 )) s"
if [ "$(left 580)" -gt 120 ]; then
  wait $JIT; tail -1 "$OUT/exl_jit.txt"
  timeout "$(left 580)" python3 scripts/device/exllamav2_compare.py --out "$R" --random-dir /tmp/models/llama3-70b \
    --skip-compat --context 1024 --decode-tokens 32 --prefill-tokens 512 > "$R/exl_compare_70b.txt" 2>&1
  grep -E "exllamav2 no_sdpa" "$R/exl_compare_70b.txt" | cut -c1-200; tail -2 "$R/exl_compare_70b.txt" | cut -c1-300
fi
echo "total $(( $(date +%s) - T0 )) s"
