#!/usr/bin/env bash
# Device call AN1 (prepared in session 24, not yet run; ~500 s). Carry .whl and .dev/libexl2_kernels.so.gz built
# from the commit that runs (bash scripts/build_variant.sh "" .dev/libexl2_kernels.so.gz; C ABI 10). Two switches
# of session 24, both off until this call measures them:
# - EXL2_BACKEND_ATTN_STREAM=1: the streamed fp16 decode attention (csrc/layers/paged_attention_stream.cu: a CTA per
#   split takes all kv heads, 16-token chunks of K and V as bulk copies into a ~192 KB ring, one CTA per SM). The
#   tensor-core one-pass kernel the fp16 decode runs takes ~49 us per layer at 32k for ~32 us of bytes; issue 6's
#   10x ExLlamaV2 at 32k (fp16) needs ~300 tok/s against 263.
# - EXL2_BACKEND_GRAPH_IO=1: the greedy decode step with its host I/O inside the graph (runtime/greedy_graphs.py);
#   the engine's step was 38.6 us over its graph replay in AL2.
#  1. GPU tests of both (kernels against references, graph replays, the lookahead on a tiny model off and on).
#  2. attention_sweep (fp16) at 32k and 1k: the default route (CTA targets 2 / 4) against the streamed kernel's
#     automatic split and 66 / 132 splits; at 1k also its minimum split of 64 keys; at both without its L2 prefetch
#     before the PDL wait (EXL2_ATTN_STREAM_PREFETCH=0).
#  3. bench 1k and 32k (fp16): default, STREAM, STREAM + GRAPH_IO.
#  4. In the time left: profile_engine_step (8B, 1k) off / GRAPH_IO; profile_decode (critical path at 1k) with STREAM.
# The default flips for a switch that wins with its tests passed.
export EXL2_CARRIED_LIBRARY=1
source scripts/device/common.sh
begin_call an1
S=EXL2_BACKEND_ATTN_STREAM=1
gpu_tests stream 100 -n 10 tests/kernels/test_paged_attention_stream.py tests/kernels/test_paged_attention.py \
  -k "stream or Stream or streamed"
gpu_tests graph_io 70 -n 8 tests/kernels/test_decode_io_kernel.py tests/engine/test_lookahead_tiny.py
echo "elapsed $(( $(date +%s) - T0 )) s"
for ctx in 32768 1024; do
  timeout 50 python3 scripts/attention_sweep.py --context $ctx --types fp16 --ctas 2,4 \
    --json "$R/sweep_d$ctx.json" > "$R/sweep_d$ctx.txt" 2>&1
  env $S timeout 50 python3 scripts/attention_sweep.py --context $ctx --types fp16 --splits 0,66,132 \
    --json "$R/sweep_s$ctx.json" > "$R/sweep_s$ctx.txt" 2>&1
  echo "== sweep $ctx default / stream"; grep -hE "ctas/SM|splits [0-9]|Error" "$R/sweep_d$ctx.txt" "$R/sweep_s$ctx.txt"
done
env $S EXL2_BACKEND_ATTN_STREAM_MIN_SPLIT=64 timeout 40 python3 scripts/attention_sweep.py --context 1024 \
  --types fp16 --splits 0 > "$R/sweep_s1024_m64.txt" 2>&1
echo "-- stream 1k, min split 64"; grep -hE "splits [0-9]|Error" "$R/sweep_s1024_m64.txt"
for ctx in 32768 1024; do  # without the L2 prefetch of the ring's first fill before the PDL wait
  env $S EXL2_ATTN_STREAM_PREFETCH=0 timeout 40 python3 scripts/attention_sweep.py --context $ctx --types fp16 \
    --splits 0 > "$R/sweep_s${ctx}_nopf.txt" 2>&1
  echo "-- stream $ctx, no prefetch"; grep -hE "splits [0-9]|Error" "$R/sweep_s${ctx}_nopf.txt"
done
echo "elapsed $(( $(date +%s) - T0 )) s"
bench_8b D 80 1024,32768 fp16
bench_8b S 80 1024,32768 fp16 $S
bench_8b SIO 80 1024,32768 fp16 $S EXL2_BACKEND_GRAPH_IO=1
echo "elapsed $(( $(date +%s) - T0 )) s"
for v in D IO; do
  t=$(left 520); [ "$t" -gt 30 ] || break
  env $([ $v = IO ] && echo EXL2_BACKEND_GRAPH_IO=1) timeout "$t" python3 scripts/profile_engine_step.py \
    --shape llama3-8b --workdir /tmp/models --context 1024 --json "$R/engine_step_$v.json" > "$R/engine_step_$v.txt" 2>&1
  echo "-- engine step $v"; grep -v Warning "$R/engine_step_$v.txt" | head -14 | cut -c1-160
done
[ "$(left 580)" -gt 50 ] && { decode_step_1k S nochain $S; attention_paths S; }
echo "total $(( $(date +%s) - T0 )) s"
