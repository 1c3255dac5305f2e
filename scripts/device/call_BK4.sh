#!/usr/bin/env bash
# NOT RUN (session 44: four starts failed, then too little device time to start a machine). The code it measures
# was taken back out (af11dcf). To run it: `git show f81f4e2 -- csrc | git apply`, build, pack the library as N
# (scripts/device/pack_library.sh), and carry the current library (1d3265a's csrc) as .dev/lib_a.so.gz and
# 453bdb4's as .dev/lib_old.so.gz.
# Device call BK4 (session 44; carry .whl and .dev; BK4_LIMIT seconds (250), steps in order as time allows;
# BK4_BITS="auto" compares the staged kernels only). After BK1 (the lean code-page attention, bit-identical,
# q4 attention -2.7%): the staged kernel copies its ring's first steps before the PDL wait where the previous
# kernel wrote none of their keys (ncu in BK1: a third of the q4 kernel's stall samples in its prologue and
# epilogue, ~10 steps per warp at 32k). Libraries: N (.dev/libexl2_kernels.so.gz, this commit), A (.dev/lib_a.so.gz,
# BK1's N, 1d3265a), O (.dev/lib_old.so.gz, 453bdb4).
#  1. outputs bit for bit, O against N (scripts/device/attn_bits.py), staged and register kernels;
#  2. the attention / KV GPU tests and the engine tests over quantized pages in captured graphs against the CPU
#     reference (tests/engine/test_staged_attention_engine.py, new), the cache-type and streamed-attention ones;
#  3. the 32k attention alone, q4 / q8, A N A N; `bench` 32k q8 / q4 N then A (as time allows); verify costs A N A N (the verify
#     steps' fp16 pages run the staged kernel with shared row tiles).
export EXL2_CARRIED_LIBRARY=1
source scripts/device/common.sh
begin_call bk4
L=${BK4_LIMIT:-250}
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
use_libraries O=.dev/lib_old.so.gz A=.dev/lib_a.so.gz
attn_bits_against_old ${BK4_BITS:-auto 0}
echo "elapsed $(( $(date +%s) - T0 )) s"
each_library "$L" 40 "A D A D" attention_sweep_32k q4,q8 3
fits 60 "attention tests" "$L" && gpu_tests attention 60 -n 8 tests/kernels/test_paged_attention.py tests/kernels/test_paged_attention_stream.py \
  tests/kernels/test_kv_quant_kernels.py tests/kernels/test_prefill_attention.py
fits 60 "engine tests" "$L" && gpu_tests engine "$(( $(left "$L") - 5 ))" -n 4 tests/engine/test_staged_attention_engine.py tests/engine/test_stream_attention_engine.py \
  tests/engine/test_cache_types.py tests/engine/test_prefill_memory.py tests/serve/test_batch_invariance.py
echo "elapsed $(( $(date +%s) - T0 )) s"
each_library "$L" 40 "A D A D" spec_line
each_library "$L" 110 "D A" bench_8b 110 32768 q8,q4  # $R/bench_<L><n>.txt
echo "total $(( $(date +%s) - T0 )) s"
