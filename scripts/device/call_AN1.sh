#!/usr/bin/env bash
# Device call AN1 (prepared in session 24, reviewed in session 25, not yet run; ~560 s). Carry .whl and
# .dev/libexl2_kernels.so.gz built from the commit that runs (bash scripts/build_variant.sh ""
# .dev/libexl2_kernels.so.gz; C ABI 10). Two switches of session 24, both off until this call measures them:
# - EXL2_BACKEND_ATTN_STREAM=1: the streamed decode attention (csrc/layers/paged_attention_stream.cu: a CTA per
#   split takes all kv heads, 16-token chunks of K and V (and their scales) as bulk copies into a ~170-192 KB ring,
#   one CTA per SM), fp16 and code pages. At 32k the fp16 decode attention takes ~49 us per layer for ~32 us of
#   bytes, code pages run at 46% (q8) / 28% (q4) of the bandwidth; issue 6's 10x ExLlamaV2 at 32k (fp16) needs
#   ~300 tok/s against 263, and q8 / q4 must stay above fp16 there.
# - EXL2_BACKEND_GRAPH_IO=1: the greedy decode step with its host I/O inside the graph (runtime/greedy_graphs.py);
#   the engine's step was 38.6 us over its graph replay in AL2.
#  1. GPU tests of both (kernels against references, graph replays, the lookahead on a tiny model off and on), and
#     session 25's NaN-logits check in the GPU sampling path (tests/engine/test_sampled_gpu_tiny.py).
#  2. attention_sweep at 32k (fp16, q8, q4) and 1k (fp16): the default route against the streamed kernel's automatic
#     split.
#  3. bench: fp16 at 1k and 32k, default against STREAM; q8 / q4 at 32k likewise; fp16 at 1k with STREAM + GRAPH_IO.
#  4. In the time left: fp16 sweeps of the streamed kernel at 66 / 132 splits, with a minimum split of 64 keys at 1k
#     and without the L2 prefetch before the PDL wait (EXL2_ATTN_STREAM_PREFETCH=0); profile_engine_step (8B, 1k)
#     off / GRAPH_IO. Every step after the tests runs only where its timeout fits before 575 s.
# The default flips for a switch that wins with its tests passed.
export EXL2_CARRIED_LIBRARY=1
source scripts/device/common.sh
begin_call an1
S=EXL2_BACKEND_ATTN_STREAM=1
gpu_tests stream 120 -n 12 tests/kernels/test_paged_attention_stream.py tests/kernels/test_paged_attention.py \
  tests/kernels/test_kv_quant_kernels.py -k "stream or Stream or streamed or bad_kernel_codes"
gpu_tests graph_io 90 -n 8 tests/kernels/test_decode_io_kernel.py tests/engine/test_lookahead_tiny.py \
  tests/engine/test_sampled_gpu_tiny.py
echo "elapsed $(( $(date +%s) - T0 )) s"
# Each sweep and bench only where its whole timeout fits before 575 s (common.sh fits).
sweep() {  # sweep NAME CONTEXT TYPES CELLS [ENV=VALUE...]: CELLS is --ctas A,B or --splits A,B
  local name=$1 ctx=$2 types=$3 cells=$4; shift 4
  fits 60 "sweep $name" || return 0
  env "$@" timeout 60 python3 scripts/attention_sweep.py --context "$ctx" --types "$types" $cells \
    --json "$R/sweep_$name.json" > "$R/sweep_$name.txt" 2>&1
  echo "-- sweep $name ($*)"; grep -hE "ctas/SM|splits [0-9]|Error" "$R/sweep_$name.txt"
}
# The decisive figures first (each route at its own split, then end to end); the variants after, in the time left.
sweep d32k 32768 fp16,q8,q4 "--ctas 2,3,4"
sweep s32k 32768 fp16,q8,q4 "--splits 0" $S
sweep d1k 1024 fp16 "--ctas 2,4"
sweep s1k 1024 fp16 "--splits 0" $S
echo "elapsed $(( $(date +%s) - T0 )) s"
fits 70 "bench D" && bench_8b D 70 1024,32768 fp16
fits 70 "bench S" && bench_8b S 70 1024,32768 fp16 $S
fits 90 "bench Dq" && bench_8b Dq 90 32768 q8,q4
fits 90 "bench Sq" && bench_8b Sq 90 32768 q8,q4 $S
fits 50 "bench SIO" && bench_8b SIO 50 1024 fp16 $S EXL2_BACKEND_GRAPH_IO=1
echo "elapsed $(( $(date +%s) - T0 )) s"
sweep s32k_splits 32768 fp16 "--splits 66,132" $S
sweep s32k_nopf 32768 fp16 "--splits 0" $S EXL2_ATTN_STREAM_PREFETCH=0
sweep s1k_m64 1024 fp16 "--splits 0" $S EXL2_BACKEND_ATTN_STREAM_MIN_SPLIT=64
sweep s1k_nopf 1024 fp16 "--splits 0" $S EXL2_ATTN_STREAM_PREFETCH=0
for v in D IO; do
  t=$(left 585); [ "$t" -gt 40 ] || break
  env $([ $v = IO ] && echo EXL2_BACKEND_GRAPH_IO=1) timeout "$t" python3 scripts/profile_engine_step.py \
    --shape llama3-8b --workdir /tmp/models --context 1024 --json "$R/engine_step_$v.json" > "$R/engine_step_$v.txt" 2>&1
  echo "-- engine step $v"; grep -v Warning "$R/engine_step_$v.txt" | head -14 | cut -c1-160
done
echo "total $(( $(date +%s) - T0 )) s"
