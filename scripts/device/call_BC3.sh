#!/usr/bin/env bash
# Device call BC3 (session 36; run again as BC4 (two warps per kv head) and BC5 (one work area for K then V); carry .whl and .dev/libexl2_kernels.so.gz; ~560 s). The streamed attention over code
# pages on tensor cores (csrc/layers/paged_attention_stream_mma_quant.cu, EXL2_BACKEND_ATTN_STREAM_QUANT=1, off):
#  1. Its GPU tests (q8 / q6 / q4 / fp8 pages, 1 / 2 / 4 / 8 query heads per kv head, one split or many, 33k keys),
#     the fp16 streamed kernel's (its chunk step now in attn_stream_mma.cuh) and the kv-quant kernel suite with the
#     new `stream_mma` case (graph replay, determinism, strided q).
#  2. The decode attention alone at 32k and 1k (scripts/attention_sweep.py, automatic splits) with and without it.
#  3. bench 1k / 32k for q8 and q4 with and without it, and fp16 (the refactored fp16 kernel's figures).
export EXL2_CARRIED_LIBRARY=1
source scripts/device/common.sh
begin_call ${BC_NAME:-bc3}
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader
L=${BC3_LIMIT:-560}
gpu_tests stream 100 -n 8 tests/kernels/test_paged_attention_stream.py
gpu_tests kvq 110 -n 8 tests/kernels/test_kv_quant_kernels.py -k "stream_mma or stream"
echo "elapsed $(( $(date +%s) - T0 )) s"
for ctx in 32768 1024; do
  for v in 0 1; do
    fits 40 "sweep $ctx $v" "$L" && { EXL2_BACKEND_ATTN_STREAM_QUANT=$v timeout 40 python3 scripts/attention_sweep.py \
      --context $ctx --types q8,q4 --splits 0 --json "$R/sweep_${ctx}_$v.json" > "$R/sweep_${ctx}_$v.txt" 2>&1
      echo "== sweep $ctx stream_quant=$v"; grep -E "q8|q4|Error" "$R/sweep_${ctx}_$v.txt" | head -6; }
  done
done
echo "elapsed $(( $(date +%s) - T0 )) s"
fits 130 "bench quant on" "$L" && bench_8b qon 130 1024,32768 q8,q4 EXL2_BACKEND_ATTN_STREAM_QUANT=1
fits 130 "bench quant off" "$L" && bench_8b qoff 130 1024,32768 fp16,q8,q4
grep -E "read bandwidth" "$R/bench_qoff.txt" | head -1
echo "total $(( $(date +%s) - T0 )) s"
