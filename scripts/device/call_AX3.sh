#!/usr/bin/env bash
# Device call AX3 (session 33; carry .whl and .dev/libexl2_kernels.so.gz; ~120 s): the shortest check of this
# session's final library when call_AX2.sh cannot fit the device time left: the streamed kernels' GPU tests on the
# refactored library (attn_stream_ring.cuh), the engine through the new default, and bench fp16 at 1k / 32k.
export EXL2_CARRIED_LIBRARY=1
source scripts/device/common.sh
begin_call ax3
nvidia-smi --query-gpu=name --format=csv,noheader
gpu_tests_verbose stream 60 -n 12 tests/kernels/test_paged_attention_stream.py tests/kernels/test_paged_attention.py \
  tests/kernels/test_kv_quant_kernels.py tests/engine/test_stream_attention_engine.py \
  -k "stream or Stream or streamed or tensor_core or bad_kernel_codes"
echo "elapsed $(( $(date +%s) - T0 )) s"
fits 70 "bench" "${AX3_LIMIT:-150}" && bench_8b final 70 1024,32768 fp16
echo "total $(( $(date +%s) - T0 )) s"
