#!/usr/bin/env bash
# Device call H2 (prepared in session 5; carry .whl and .dev/libexl2_kernels.so.gz): issue 3's other shapes. The
# 70B random model (35 GB) took more than G2's 150 s to write with one generating thread; the writer now keeps up
# to 8 modules in flight ahead of it (format/random_model.py).
export EXL2_CARRIED_LIBRARY=1
source scripts/device/common.sh
results_dir
trap '[ -d "$R" ] && pack_results h2' EXIT
for sh in llama3-1b llama3-70b; do
  t=$(date +%s)
  timeout 280 python3 -m exl2_backend.cli.main bench --shape $sh --bpw 4.0 --model-out /tmp/models/$sh \
    --contexts 1024,8192 --json "$R/bench_$sh.json" > "$R/bench_$sh.txt" 2>&1
  echo "$sh ($(( $(date +%s) - t )) s):"; grep -B1 -A6 "decode" "$R/bench_$sh.txt" | grep -E "│ +[0-9]" | head -3
  rm -rf /tmp/models/$sh
done
