#!/usr/bin/env bash
# Device call BL3 (carry .whl and .dev; BL3_LIMIT seconds (560), steps in order as time allows), on the library with
# BL2's two winners landed: the GEMV ring 128-byte aligned (byte 640) and the staged attention copying its ring's
# first steps before the PDL wait.
#  1. GPU tests of what changed: the GEMV suites, the attention / KV / prefill attention tests, the engine tests of
#     the staged and streamed attention and batch invariance.
#  2. The closing figures: `bench` 8B at 1k and 32k (fp16 / q8 / q4), the verify step costs, ExLlamaV2 beside ours.
export EXL2_CARRIED_LIBRARY=1
source scripts/device/common.sh
begin_call bl3
L=${BL3_LIMIT:-560}
nvidia-smi --query-gpu=name --format=csv,noheader
start_exllamav2_jit
fits 70 "gemv suites" "$L" && gpu_tests gemv_suites 60 -n 12 $GEMV_GPU_TESTS
fits 100 "attention tests" "$L" && gpu_tests attention 90 -n 8 tests/kernels/test_paged_attention.py \
  tests/kernels/test_paged_attention_stream.py tests/kernels/test_kv_quant_kernels.py tests/kernels/test_prefill_attention.py
fits 70 "engine tests" "$L" && gpu_tests_verbose engine 60 -n 4 tests/engine/test_staged_attention_engine.py \
  tests/engine/test_stream_attention_engine.py tests/engine/test_cache_types.py tests/serve/test_batch_invariance.py
echo "tests $(( $(date +%s) - T0 )) s"
fits 200 "final figures" "$L" && final_figures "$L"
echo "total $(( $(date +%s) - T0 )) s"
