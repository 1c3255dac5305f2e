#!/usr/bin/env bash
# Ran in session 46 (H100, 313 s; docs/performance.md, session 46). Device call BL3 (carry .whl and .dev; BL3_LIMIT
# seconds (560), steps in order as time allows), on the library with BL2's two winners landed: the GEMV ring 128-byte
# aligned (byte 640) and the staged attention copying its ring's
# first steps before the PDL wait.
#  1. GPU tests of what changed: the GEMV suites, the attention / KV / prefill attention tests, the engine tests of
#     the staged and streamed attention and batch invariance.
#  2. The fp16 streamed attention's row pitch (measurement builds EXL2_STREAM_ROW_PAD, a macro
#     since removed; the carried .dev held them):
#     D 2,064 bytes (rows 16 bytes into a line, conflict-free ldmatrix), R 2,176 (line-aligned rows, 8-way ldmatrix
#     conflicts), X 2,080 (32 bytes in, 2-way conflicts); 32k attention alone, D R X D R X.
#  3. The closing figures: `bench` 8B at 1k and 32k (fp16 / q8 / q4), the verify step costs.
#  4. ExLlamaV2 beside ours at 1k, with what time is left.
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
use_libraries R=.dev/lib_row128.so.gz X=.dev/lib_row32.so.gz
fp16_stream_32k() {
  timeout 60 python3 scripts/attention_sweep.py --context 32768 --types fp16 --splits 0 --json "$R/sweep16_$1.json" \
    > "$R/sweep16_$1.txt" 2>&1
  echo "== fp16 $1: $(grep -E "splits|Error" "$R/sweep16_$1.txt" | tail -1)"
}
each_library "$L" 40 "D R X D R X" fp16_stream_32k
fits 200 "bench" "$L" && { bench_8b final 130 1024,32768 fp16,q8,q4; spec_costs final; }
echo "bench $(( $(date +%s) - T0 )) s"
[ "$(left "$L")" -gt 90 ] && exllamav2_vs_ours "$(left "$L")"
echo "total $(( $(date +%s) - T0 )) s"
