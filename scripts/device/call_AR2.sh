#!/usr/bin/env bash
# Device call AR2 (prepared in session 27, not yet run: device loans paused; ~450 s). Carry .whl and
# .dev/libexl2_kernels.so.gz built from the commit that runs.
#  1. The sampler kernel now flags a row whose logits hold a NaN (-1, in every mode) while it reads it, so the greedy
#     lookahead and greedy graphs (graph I/O, the default since AR1) fail that sequence instead of emitting and
#     feeding back the NaN's index: the sampler and decode-io kernel tests, and the tiny-model engine tests (a NaN
#     written into one sequence's V page mid-decode, both lookahead paths; logprobs, prompt logprobs and logit bias on the GPU engine;
#     session 28's grammar masks on GPU logits, alone and in the engine: .whl carries llguidance; session 28 also
#     flags +inf logits, an fp16 overflow, as NaN: test_faulty_rows_give_minus_one_in_every_mode[posinf]).
#  3. Last, if time is left (session 28): scripts/grammar_bench.py on the random 8B, per-token cost of a grammar.
#  2. Session 23's prepared call_AM2.sh (folded in here, removed): which kernel should take fp16 pages at decode.
#     The tensor-core one-pass kernel by CTAs per SM (2 / 3 / 4) against the CUDA-core one
#     (EXL2_BACKEND_ATTN_FP16_MMA=0; 2 / 4 / 6 / 8 / 12) at 32k and 1k (scripts/attention_sweep.py), then bench fp16
#     at 1k and 32k of the default (its 1k row also shows the sampler's NaN flag costs nothing against AR1's 436.3
#     tok/s) and of the CUDA-core kernel at its best cell.
export EXL2_CARRIED_LIBRARY=1
source scripts/device/common.sh
begin_call ar2
gpu_tests_verbose engine 170 -n 4 --dist loadfile --timeout 160 tests/engine/test_lookahead_tiny.py \
  tests/engine/test_sampled_gpu_tiny.py tests/kernels/test_sampling_kernel.py tests/kernels/test_decode_io_kernel.py \
  tests/unit/test_grammar_mask.py
echo "elapsed $(( $(date +%s) - T0 )) s"
attention_sweep_32k mma fp16 2,3,4
attention_sweep_32k cc fp16 2,4,6,8,12 EXL2_BACKEND_ATTN_FP16_MMA=0
CC_CTAS=$(python3 -c "import json; r = json.load(open('$R/sweep_cc.json'))['results']['fp16']
print(min(r, key=lambda c: r[c]['us']))" 2>/dev/null || echo 4)
echo "CUDA-core kernel's best CTAs per SM at 32k: $CC_CTAS; elapsed $(( $(date +%s) - T0 )) s"
for v in mma cc; do
  fits 60 "sweep 1k $v" 480 || break
  env $([ $v = cc ] && echo EXL2_BACKEND_ATTN_FP16_MMA=0) timeout 60 python3 scripts/attention_sweep.py \
    --context 1024 --types fp16 --ctas 2,4,8 --json "$R/sweep1k_$v.json" > "$R/sweep1k_$v.txt" 2>&1
  echo "== sweep 1k $v"; grep -E "ctas/SM|Error" "$R/sweep1k_$v.txt"
done
fits 90 "bench D" 560 && bench_8b D 90 1024,32768 fp16
fits 90 "bench CC" 560 && bench_8b CC 90 1024,32768 fp16 EXL2_BACKEND_ATTN_FP16_MMA=0 \
  EXL2_BACKEND_ATTN_CTAS_PER_SM=$CC_CTAS
# the 1B shape with graph I/O (AE2 without it: 768.6 tok/s engine / 1,311.1 graph at 1k, its engine step host-bound)
fits 60 "bench 1B" 575 && { timeout 60 python3 -m exl2_backend.cli.main bench --shape llama3-1b --bpw 4.0 \
  --model-out /tmp/models/llama3-1b --contexts 1024 --cache-type fp16 --json "$R/bench_1b.json" > "$R/bench_1b.txt" 2>&1
  echo "== bench 1B"; grep -E "^│ +[0-9]+ │" "$R/bench_1b.txt"; }
# session 28: what a grammar costs per token on the 8B (plain lookahead / eager sampling / eager + masks)
fits 60 "grammar bench" 575 && [ -d /tmp/models/llama3-8b ] && { timeout 60 python3 scripts/grammar_bench.py \
  /tmp/models/llama3-8b --tokens 128 --json "$R/grammar_bench.json" > "$R/grammar_bench.txt" 2>&1
  echo "== grammar bench"; tail -4 "$R/grammar_bench.txt"; }
echo "total $(( $(date +%s) - T0 )) s"
