#!/usr/bin/env bash
# Device call AG1 (session 18; carry .whl and .dev/libexl2_kernels.so.gz; ~560 s): the RMSNorm split across the
# GEMVs around it (ops/cuda_split_norm.py, csrc/quant/exl2_gemv_norm_partials.cuh; C ABI 10), never run. o_proj and
# down_proj add the residual and leave block partials of the sums of squares; gate/up and q/k/v normalize their own
# rows from them, so a verify step loses its 65 norm launches (AF3: 306 us of the k = 4 verify's critical path) and
# a decode step its whole-row norm in every consumer block. Every norm now sums squares in one order
# (csrc/layers/rms_ssq.cuh).
#  1. GPU tests: the split norm against add_rms_norm between plain GEMVs (bit-identity), the fused and pre-gathering
#     norms and rms_norm in the new order, the model forward with the split on and off;
#  2. verify / decode step costs with the split (default) and without (EXL2_BACKEND_SPLIT_NORM=0), interleaved;
#  3. `bench` at 1k and 32k (fp16 / q8 / q4);
#  4. the engine's and speculation's GPU tests, the fused rope and chain tests (every norm path end to end).
export EXL2_CARRIED_LIBRARY=1
source scripts/device/common.sh
begin_call ag1
gpu_tests_verbose norms 150 -n 12 tests/kernels/test_gemv_split_norm.py tests/kernels/test_gemv_norm.py \
  tests/kernels/test_layers.py -k "split or norm"
echo "elapsed $(( $(date +%s) - T0 )) s"
spec_costs split1
spec_costs nosplit1 EXL2_BACKEND_SPLIT_NORM=0
spec_costs split2
spec_costs nosplit2 EXL2_BACKEND_SPLIT_NORM=0
echo "elapsed $(( $(date +%s) - T0 )) s"
bench_8b final 130 1024,32768 fp16,q8,q4
echo "elapsed $(( $(date +%s) - T0 )) s"
gpu_tests_verbose engine "$(left 555)" -n 12 tests/engine/test_gpu_parity.py tests/spec/test_spec_cuda.py \
  tests/kernels/test_gemv_rope_kv.py tests/serve/test_batch_invariance.py tests/kernels/test_gemv_chain.py
echo "total $(( $(date +%s) - T0 )) s"
