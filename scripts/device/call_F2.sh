#!/usr/bin/env bash
# Device call F2 (next session, after F1; carry .whl and .dev/libexl2_kernels.so.gz): the TMA GEMV for M = 9..32
# (two or four token tiles per decode) against the mma kernel and dequantize + cuBLAS, and what it does to the
# k = 8 verify (issue 7) and to a 32-token prefill over a cached prefix (issue 6).
#  1. its kernel tests (token tiles, gated, cluster); 2. bench_gemm (M = 1..32 per shape, crossover);
#  3. verify costs k = 1..8 with M <= 8 and M <= 16 routed to the GEMV;
#  4. prefix-cache time to first token (4096 shared + 32 new tokens) with the 32-token suffix's linears on the GEMV
#     and its attention on the decode kernel (EXL2_BACKEND_DECODE_ATTN_MAX_Q=32) or not.
export EXL2_CARRIED_LIBRARY=1
source scripts/device/common.sh
results_dir
t=$(date +%s)
timeout 120 python3 -m pytest tests/kernels/test_exl2_gemm.py -q -m cuda -p no:cacheprovider --timeout 60 -rf \
  -k "token_tiles or cluster or rejects" 2>&1 | tee "$R/tiles_tests.txt" | grep -E "FAILED|passed|failed|Error" | tail -4
timeout 60 python3 -m pytest tests/kernels/test_paged_attention.py -q -m cuda -p no:cacheprovider --timeout 60 -rf \
  -k row_tiles 2>&1 | tee "$R/attn_tests.txt" | grep -E "FAILED|passed|failed|Error" | tail -3
echo "tests $(( $(date +%s) - t )) s"; t=$(date +%s)
timeout 200 python3 scripts/bench_gemm.py --quick > "$R/bench_gemm.txt" 2>&1; grep -A40 "^shape" "$R/bench_gemm.txt" | head -45
echo "bench_gemm $(( $(date +%s) - t )) s"; t=$(date +%s)
for mm in 8 16; do
  EXL2_BACKEND_GEMV_MAX_M=$mm EXL2_BACKEND_FUSED_MAX_M=$mm timeout 70 python3 scripts/spec_bench.py --skip smollm2 \
    --iters 30 --work-dir /tmp/spec_bench --out "$R/spec_costs_m$mm.json" 2> "$R/spec_costs_m$mm.log"
  echo "GEMV up to M=$mm: $(grep 'step costs' "$R/spec_costs_m$mm.log" | tail -1)"
done
echo "spec $(( $(date +%s) - t )) s"; t=$(date +%s)
# issue 6: time to first token of 4096 shared + 32 new tokens, second request, with the 32-row suffix on the GEMV
[ -f /tmp/models/llama3-8b/config.json ] || python3 -c "from exl2_backend.format.random_model import \
write_random_exl2_model as w; w('/tmp/models/llama3-8b', 'llama3-8b', bpw=4.0)"
for cfg in "8 16" "32 16" "32 32"; do  # GEMV rows, decode-attention queries (the rest: dequant+cuBLAS, blocked SDPA)
  set -- $cfg
  EXL2_BACKEND_GEMV_MAX_M=$1 EXL2_BACKEND_FUSED_MAX_M=$1 EXL2_BACKEND_DECODE_ATTN_MAX_Q=$2 timeout 90 \
    python3 scripts/prefix_prefill.py /tmp/models/llama3-8b --long 0 --json "$R/prefix_m$1_q$2.json" \
    > "$R/prefix_m$1_q$2.txt" 2>&1
  echo "GEMV up to M=$1, decode attention up to Tq=$2: $(tail -2 "$R/prefix_m$1_q$2.txt" | tr '\n' ' ')"
done
echo "prefix $(( $(date +%s) - t )) s"
pack_results f2
