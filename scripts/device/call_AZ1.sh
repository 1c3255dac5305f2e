#!/usr/bin/env bash
# Device call AZ1 (session 34; carry .whl and .dev/libexl2_kernels.so.gz; ~560 s; AZ1_LIMIT=280 keeps the tests, one
# round of step costs and the engine tests). The norm handoff
# (ops/cuda_handoff.py, csrc/quant/exl2_gemv_handoff.cuh; EXL2_BACKEND_NORM_HANDOFF=all|verify, off by default):
# o_proj and down also write the next residual stream and its per-256-column sums of squares, gate/up and q/k/v
# normalize only their own rows of it, so a verify step runs no norm launches (AF3: 306 us of its critical path).
# Verify attention on the tensor-core streamed kernel is now the default (AY1). AZ2 / AZ3 (session 34, H100) ran the
# first consumer: its tests passed, it lost at every M (r and w gathered together took M rounds); this call measures
# the rewritten consumer (the weight staged before the PDL wait, the plain row-slot gather, scaling in place).
#  1. The handoff's kernel tests beside the fused-norm, rope and GEMV tests it shares code with.
#  2. Verify / decode step costs: default D, handoff in every step A, handoff in verify steps only V (two rounds,
#     the engine tests between them).
#  3. The engine through the handoff: the streamed-attention engine test (teacher-forced logits against the CPU),
#     speculation's greedy identity and the lookahead on tiny models, with A (and speculation with V).
#  4. The kernel tables of the decode and verify graphs (spec_bench --kernels), D then V.
export EXL2_CARRIED_LIBRARY=1
source scripts/device/common.sh
begin_call az1
nvidia-smi --query-gpu=name --format=csv,noheader
L=${AZ1_LIMIT:-560}
gpu_tests handoff 100 -n 12 tests/kernels/test_gemv_handoff.py tests/kernels/test_gemv_norm.py \
  tests/kernels/test_gemv_rope_kv.py tests/kernels/test_paged_attention_stream.py
echo "elapsed $(( $(date +%s) - T0 )) s"
fits 80 "spec costs, round 1" "$L" && for v in D A=EXL2_BACKEND_NORM_HANDOFF=all V=EXL2_BACKEND_NORM_HANDOFF=verify; do
  if [[ $v == *=* ]]; then spec_costs "${v%%=*}1" "${v#*=}"; else spec_costs "${v}1"; fi; done
echo "elapsed $(( $(date +%s) - T0 )) s"
fits 100 "engine tests, handoff all" "$L" && EXL2_BACKEND_NORM_HANDOFF=all gpu_tests engine_all 100 -n 8 \
  tests/engine/test_stream_attention_engine.py tests/spec/test_spec_gpu_tiny.py tests/engine/test_lookahead_tiny.py
fits 80 "spec costs, round 2" "$L" && for v in D A=EXL2_BACKEND_NORM_HANDOFF=all V=EXL2_BACKEND_NORM_HANDOFF=verify; do
  if [[ $v == *=* ]]; then spec_costs "${v%%=*}2" "${v#*=}"; else spec_costs "${v}2"; fi; done
fits 70 "engine tests, handoff verify" "$L" && EXL2_BACKEND_NORM_HANDOFF=verify gpu_tests engine_verify 70 -n 8 \
  tests/spec/test_spec_gpu_tiny.py
echo "elapsed $(( $(date +%s) - T0 )) s"
# Where a k = 4 verify step's time goes, default and handoff (critical path per kernel; AF3's table for D)
for v in D V; do
  fits 60 "kernel tables $v" "$L" && { [ $v = V ] && export EXL2_BACKEND_NORM_HANDOFF=verify
    timeout 60 python3 scripts/spec_bench.py --skip smollm2 --iters 20 --kernels --work-dir /tmp/spec_bench \
      --out "$R/kernels_$v.json" > "$R/kernels_$v.txt" 2>&1; unset EXL2_BACKEND_NORM_HANDOFF
    echo "== kernels $v: $(grep -c . "$R/kernels_$v.txt") lines"; }
done
echo "total $(( $(date +%s) - T0 )) s"
