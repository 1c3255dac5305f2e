#!/usr/bin/env bash
# Device call BC2 (session 36; carry .whl and .dev/libexl2_kernels.so.gz; ~420 s). csrc/ unchanged (C ABI 13); the
# host side changed:
#  1. Verify steps cut short contexts into splits of at least ATTN_STREAM_VERIFY_MIN_SPLIT = 32 keys (decode steps
#     keep 16; BC1, one run each: k = 4 verify 2.947 -> 2.883 ms). Its GPU tests (the streamed kernels, the new
#     verify min-split test), the engine's speculation tests, then step costs default / 16 / 48 interleaved twice.
#  2. Measurement switches for the GEMV at M > 1 (a k = 4 verify's GEMVs take +215 us over the decode step's for
#     the same bytes), one spec_bench each: split-K aimed at 1.5 / 1 blocks per SM for M > 1
#     (EXL2_BACKEND_GEMV_BLOCKS_PER_SM_MULTI, removed after this call: it lost), the row-slot gather
#     (EXL2_GEMV_GATHER=rows), no pre-gather launch (EXL2_BACKEND_GEMV_PREGATHER_ITEMS=0).
export EXL2_CARRIED_LIBRARY=1
source scripts/device/common.sh
begin_call bc2
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader
L=${BC2_LIMIT:-430}
gpu_tests stream 60 -n 8 tests/kernels/test_paged_attention_stream.py tests/unit/test_attention_planning.py
gpu_tests spec 90 -n 4 tests/spec/test_spec_gpu_tiny.py tests/engine/test_stream_attention_engine.py \
  tests/engine/test_lookahead_tiny.py tests/engine/test_sampled_lookahead_tiny.py
echo "elapsed $(( $(date +%s) - T0 )) s"
for round in 1 2; do
  fits 30 "spec default $round" "$L" && spec_costs "d$round"
  fits 30 "spec v16 $round" "$L" && spec_costs "v16_$round" EXL2_BACKEND_ATTN_STREAM_VERIFY_MIN_SPLIT=16
  fits 30 "spec v48 $round" "$L" && spec_costs "v48_$round" EXL2_BACKEND_ATTN_STREAM_VERIFY_MIN_SPLIT=48
done
echo "elapsed $(( $(date +%s) - T0 )) s"
fits 30 "spec multi 1.5" "$L" && spec_costs multi15 EXL2_BACKEND_GEMV_BLOCKS_PER_SM_MULTI=1.5
fits 30 "spec multi 1" "$L" && spec_costs multi1 EXL2_BACKEND_GEMV_BLOCKS_PER_SM_MULTI=1
fits 30 "spec gather rows" "$L" && spec_costs rows EXL2_GEMV_GATHER=rows
fits 30 "spec no pregather" "$L" && spec_costs nopre EXL2_BACKEND_GEMV_PREGATHER_ITEMS=0
fits 30 "spec default 3" "$L" && spec_costs d3
echo "total $(( $(date +%s) - T0 )) s"
