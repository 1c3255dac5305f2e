#!/usr/bin/env bash
# Device call P2 (prepared in session 9; carry .whl and .dev/libexl2_kernels.so.gz). Two environment-only A/Bs:
#  1. GEMV work balance: session 9's stamps showed an SM's second block streaming ~28% slower than its first
#     (gate/up in the chain, N2), so a launch lasts as long as its slowest blocks. Planning more, smaller blocks
#     than stay resident (EXL2_BACKEND_GEMV_BLOCKS_PER_SM 4 / 6: two or three waves of the two resident blocks)
#     lets the block scheduler hand the fast slot more of them, at the cost of more split-K partials. (F1 planned 3
#     per SM for a 1.5-wave tail and lost; whole waves were never tried.) The 8B decode step at 1k and verify costs.
#  2. The attention variants end to end at 32k (the L1 sweep's best cells, session 8: one-pass U=2 at 2 CTAs for
#     q8, U=1 at 3 for q4, U=2 for fp16 pages; the deeper two-pass variant), one bench each.
export EXL2_CARRIED_LIBRARY=1
source scripts/device/common.sh
results_dir
trap '[ -d "$R" ] && pack_results p2' EXIT
t=$(date +%s)
for per_sm in 2 4 6; do decode_step_1k "bps$per_sm" nochain EXL2_BACKEND_GEMV_BLOCKS_PER_SM=$per_sm; done
for per_sm in 2 4; do spec_costs "bps$per_sm" EXL2_BACKEND_GEMV_BLOCKS_PER_SM=$per_sm; done
echo "balance $(( $(date +%s) - t )) s"; t=$(date +%s)
bench32k() { local name=$1; shift; bench_8b "attn_$name" 90 32768 fp16,q8,q4 "$@"; }  # name, then ENV=VALUE...
bench32k default
bench32k online2 EXL2_BACKEND_ATTN_MMA_ONLINE=2 EXL2_BACKEND_ATTN_FP16_MMA=1
bench32k online1 EXL2_BACKEND_ATTN_MMA_ONLINE=1 EXL2_BACKEND_ATTN_FP16_MMA=1
bench32k deep EXL2_ATTN_QUANT_MMA_DEEP=1
echo "attention $(( $(date +%s) - t )) s"
