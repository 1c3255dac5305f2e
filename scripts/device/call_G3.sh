#!/usr/bin/env bash
# Device call G3 (2026-12-02, session 5; carry .whl and .dev/libexl2_kernels.so.gz): the pre-gathered GEMV input
# (EXL2_BACKEND_GEMV_PREGATHER_MIN_M) against the in-kernel gather, the attention split sweep, and the prefix
# TTFT again first thing (G2 ran it after ncu and got 51.9 ms where F2 had 22.9 ms with the same routing).
#  1. prefix TTFT on a model written like F2's (and F2's environment if it is slow again);
#  2. kernel tests: default, and the GEMV tests with every M pre-gathered; the plan-vs-allocator test;
#  3. bench_gemm --quick with the pre-gather from M = 2 (G1 has the table without it, same code otherwise);
#  4. verify costs with and without the pre-gather, same run;
#  5. decode attention by cache type and split (scripts/attention_sweep.py), then the 8B decode at 32k with the
#     split that was best for q8.
export EXL2_CARRIED_LIBRARY=1
source scripts/device/common.sh
results_dir
trap '[ -d "$R" ] && pack_results g3' EXIT  # partial results too, should a step overrun the call
t=$(date +%s)
python3 -c "from exl2_backend.format.random_model import write_random_exl2_model as w; \
w('/tmp/models/llama3-8b', 'llama3-8b', bpw=4.0)" > /dev/null 2>&1
timeout 70 python3 scripts/prefix_prefill.py /tmp/models/llama3-8b --long 0 --json "$R/prefix.json" > "$R/prefix.txt" 2>&1
tail -1 "$R/prefix.txt"
if python3 -c "import json,sys; sys.exit(json.load(open('$R/prefix.json'))['ttft']['second_ms_median'] < 30)"; then
  EXL2_BACKEND_FUSED_MAX_M=32 EXL2_BACKEND_GEMV_MAX_M=32 EXL2_BACKEND_DECODE_ATTN_MAX_Q=32 timeout 70 \
    python3 scripts/prefix_prefill.py /tmp/models/llama3-8b --long 0 --json "$R/prefix_f2env.json" > "$R/prefix_f2env.txt" 2>&1
  echo "F2 environment: $(tail -1 "$R/prefix_f2env.txt")"
fi
echo "prefix $(( $(date +%s) - t )) s"; t=$(date +%s)
timeout 90 python3 -m pytest tests/kernels/test_exl2_gemm.py tests/multigpu/test_multigpu_cuda.py -q -m cuda \
  -p no:cacheprovider --timeout 60 -rf -s 2>&1 | tee "$R/tests.txt" | grep -E "FAILED|passed|failed|Error|^plan " | tail -6
EXL2_BACKEND_GEMV_PREGATHER_MIN_M=1 timeout 60 python3 -m pytest tests/kernels/test_exl2_gemm.py -q -m cuda \
  -p no:cacheprovider --timeout 60 -rf -k "gemv or pregather or routing or gated" 2>&1 | tee "$R/tests_pregather.txt" \
  | grep -E "FAILED|passed|failed|Error" | tail -4
echo "tests $(( $(date +%s) - t )) s"; t=$(date +%s)
EXL2_BACKEND_GEMV_PREGATHER_MIN_M=2 OUT="$R" timeout 100 python3 scripts/bench_gemm.py --quick > "$R/bench_gemm_pre.txt" 2>&1
grep -A24 "^shape" "$R/bench_gemm_pre.txt" | head -25
for pg in 0 2; do
  EXL2_BACKEND_GEMV_PREGATHER_MIN_M=$pg timeout 50 python3 scripts/spec_bench.py --skip smollm2 --iters 30 \
    --work-dir /tmp/spec_bench --out "$R/spec_costs_pg$pg.json" 2> "$R/spec_costs_pg$pg.log"
  echo "pre-gather from M=$pg: $(grep 'step costs' "$R/spec_costs_pg$pg.log" | tail -1)"
done
echo "gemv $(( $(date +%s) - t )) s"; t=$(date +%s)
timeout 60 python3 scripts/attention_sweep.py --ctas 2,4,6,8,12 --json "$R/attention_sweep.json" 2>&1 | tee "$R/attention_sweep.txt"
best=$(python3 -c "import json; r=json.load(open('$R/attention_sweep.json'))['results']['q8']; \
print(min(r, key=lambda c: r[c]['us']))" 2>/dev/null || echo 4)
echo "best CTAs per SM for q8: $best"
if [ "$best" != 4 ]; then
  EXL2_BACKEND_ATTN_CTAS_PER_SM=$best timeout 80 python3 -m exl2_backend.cli.main bench --shape llama3-8b --bpw 4.0 \
    --model-out /tmp/models/llama3-8b --contexts 32768 --cache-type fp16,q8,q4 --json "$R/bench_8b_ctas$best.json" \
    > "$R/bench_8b_ctas$best.txt" 2>&1
  grep -A5 "decode tokens/s by cache" "$R/bench_8b_ctas$best.txt" | tail -2
fi
echo "attention $(( $(date +%s) - t )) s"
