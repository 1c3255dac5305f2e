#!/usr/bin/env bash
# Device call AN1 (prepared in session 24, not yet run; ~300 s). Carry .whl and .dev/libexl2_kernels.so.gz built
# from the commit that runs (bash scripts/build_variant.sh "" .dev/libexl2_kernels.so.gz; C ABI 10).
# The greedy decode step with its host I/O inside the graph (EXL2_BACKEND_GRAPH_IO=1, runtime/greedy_graphs.py):
# AL2's profile put the engine's step 38.6 us over its graph replay (staging upload, token copy, the graph's five
# unpacking nodes, the sampler and the readback as separate stream operations, 28 us of idle gaps between them).
#  1. Its GPU tests: the decode_inputs / greedy_tokens_to_host kernels against their references (graph replays
#     reading and writing pinned memory included), the lookahead on a tiny random model with the switch off and on.
#  2. scripts/profile_engine_step.py (8B at 1k) off (D) and on (IO): step time, GPU busy / idle, the gaps.
#  3. bench at 1k (fp16), off and on, interleaved twice: the engine row against the graph row.
# If IO wins and its tests pass, the default flips (lookahead.py reads EXL2_BACKEND_GRAPH_IO).
export EXL2_CARRIED_LIBRARY=1
source scripts/device/common.sh
begin_call an1
gpu_tests graph_io 120 -n 8 tests/kernels/test_decode_io_kernel.py tests/engine/test_lookahead_tiny.py \
  tests/kernels/test_sampling_kernel.py
for v in D IO; do
  env $([ $v = IO ] && echo EXL2_BACKEND_GRAPH_IO=1) timeout 100 python3 scripts/profile_engine_step.py \
    --shape llama3-8b --workdir /tmp/models --context 1024 --json "$R/engine_step_$v.json" > "$R/engine_step_$v.txt" 2>&1
  echo "-- engine step $v"; grep -v Warning "$R/engine_step_$v.txt" | head -24 | cut -c1-160
done
echo "elapsed $(( $(date +%s) - T0 )) s"
for round in 1 2; do
  bench_8b D$round 60 1024 fp16
  bench_8b IO$round 60 1024 fp16 EXL2_BACKEND_GRAPH_IO=1
done
echo "total $(( $(date +%s) - T0 )) s"
