#!/usr/bin/env bash
# Device call AE2 (prepared in session 16, not yet run; carry .whl and .dev/libexl2_kernels.so.gz; ~500 s): issue 3's
# other shapes and ExLlamaV2 beside ours on the 70B shape in one run (issue 3 asks >= 2.5x there). Session 17 had
# the 70B at 1k in AF2 (63.9 tok/s, 53.9% of the roofline; its directory written in 28-62 s) and ExLlamaV2 on it in
# AF3 (36.7 tok/s), which the budget stopped before our side of the same run; the 1B shape was last measured in
# session 6 (989.2 tok/s, 17.2%). While the 70B directory is written and ExLlamaV2 JIT-builds: the 1B shape, and
# ncu of the staged attention at 32k (fp16 pages, opt-in there: EXL2_ATTN_STAGED=2; q4 pages, the default).
export EXL2_CARRIED_LIBRARY=1
source scripts/device/common.sh
begin_call ae2
start_exllamav2_jit
write_70b_background
timeout 120 python3 -m exl2_backend.cli.main bench --shape llama3-1b --bpw 4.0 --model-out /tmp/models/llama3-1b \
  --contexts 1024,8192 --cache-type fp16 --json "$R/bench_1b.json" > "$R/bench_1b.txt" 2>&1
echo "== 1B"; grep -E "^│ +[0-9]+ │" "$R/bench_1b.txt"
# While the 70B is written: ncu of the staged attention at 32k (what bounds it now; AC1 had the register kernel's).
ncu_attention ncu_staged_fp16 fp16 EXL2_ATTN_STAGED=2
ncu_attention ncu_staged_q4 q4
wait $W70; tail -1 "$R/write_70b.txt"
echo "elapsed $(( $(date +%s) - T0 )) s"
timeout 150 python3 -m exl2_backend.cli.main bench /tmp/models/llama3-70b --contexts 1024,8192 --cache-type fp16 \
  --json "$R/bench_70b.json" > "$R/bench_70b.txt" 2>&1
echo "== 70B"; grep -E "^│ +[0-9]+ │" "$R/bench_70b.txt"; tail -2 "$R/bench_70b.txt" | cut -c1-200
echo "elapsed $(( $(date +%s) - T0 )) s"
if [ "$(left 580)" -gt 120 ]; then
  wait $JIT; tail -1 "$OUT/exl_jit.txt"
  timeout "$(left 580)" python3 scripts/device/exllamav2_compare.py --out "$R" --random-dir /tmp/models/llama3-70b \
    --ours --skip-compat --context 1024 --decode-tokens 32 --prefill-tokens 512 > "$R/exl_compare_70b.txt" 2>&1
  grep -E "exllamav2 no_sdpa|ours:" "$R/exl_compare_70b.txt" | cut -c1-220; tail -2 "$R/exl_compare_70b.txt" | cut -c1-300
fi
echo "total $(( $(date +%s) - T0 )) s"
