#!/usr/bin/env bash
# Device call G4 (prepared in session 5, not yet run: no device time was left; ~90 s; carry .whl and .dev/libexl2_kernels.so.gz, the G3 library): the
# defaults chosen from G3 — the GEMV pre-gather where a block would gather >= 3,072 items, and the 8-bit-cache
# attention split at 6 CTAs per SM — run through their tests and the two measurements they are for.
export EXL2_CARRIED_LIBRARY=1
source scripts/device/common.sh
results_dir
trap '[ -d "$R" ] && pack_results g4' EXIT
t=$(date +%s)
timeout 50 python3 -m pytest tests/kernels/test_exl2_gemm.py tests/kernels/test_kv_quant_kernels.py -q -m cuda \
  -p no:cacheprovider --timeout 40 -rf -k "pregather or routing or token_tiles or gated or single_sequence or batch_of \
or close_to or graph or row_tiles" 2>&1 | tee "$R/tests.txt" | grep -E "FAILED|passed|failed|Error" | tail -4
echo "tests $(( $(date +%s) - t )) s"; t=$(date +%s)
timeout 40 python3 scripts/spec_bench.py --skip smollm2 --iters 30 --work-dir /tmp/spec_bench \
  --out "$R/spec_costs.json" 2> "$R/spec_costs.log"; grep 'step costs' "$R/spec_costs.log" | tail -1
timeout 60 python3 -m exl2_backend.cli.main bench --shape llama3-8b --bpw 4.0 --model-out /tmp/models/llama3-8b \
  --contexts 32768 --cache-type fp16,q8,q4 --json "$R/bench_8b_32k.json" > "$R/bench_8b_32k.txt" 2>&1
grep -A5 "decode tokens/s by cache" "$R/bench_8b_32k.txt" | tail -2
echo "measure $(( $(date +%s) - t )) s"
