#!/usr/bin/env bash
# Device call BJ1 (session 42's; ran in session 43 with BJ1_LIMIT=330 on an H100: the tail lost and was removed,
# with its tests, so this script no longer runs as written; kept as the record of the call; carry .whl and .dev):
# the next GEMV's input norm as the tail of the GEMV that produces it (ops/cuda_tail.py, EXL2_BACKEND_NORM_TAIL=1,
# opt-in; BH1's ceiling for a verify step without its norm launches: k = 4 1.146 / 1.141 of a decode step against
# 1.245 / 1.263):
# 1. its GPU tests (bit-identity with GEMV + the pre-gathering norm at every width, 1-8 rows, plain and gated
#    producers, two- and three-part consumers, the fused rope, a CUDA graph, the model forward) and the GEMV suites
#    (GemvParams grew);
# 2. spec_bench's step costs, default against the tail, interleaved twice;
# 3. the engine and speculation GPU tests with the tail on (captured verify graphs run it).
# Carry prepared with: bash scripts/device/prepare_carry.sh --no-gguf
export EXL2_CARRIED_LIBRARY=1
source scripts/device/common.sh
begin_call bj1
L=${BJ1_LIMIT:-575}  # seconds into the call every step must end by (session 43: 450, device time was short)
nvidia-smi --query-gpu=name --format=csv,noheader
gpu_tests tail_gemv 150 -n 12 tests/kernels/test_gemv_tail.py $GEMV_GPU_TESTS -k "not llama3_8b"
fits 130 "spec costs" "$L" && interleaved_spec_costs default tail=EXL2_BACKEND_NORM_TAIL=1
if fits 150 "the engine tests with the tail" "$L"; then
  (export EXL2_BACKEND_NORM_TAIL=1; gpu_tests_verbose tail_engine "$(( $(left "$L") - 10 ))" -n 6 tests/engine tests/spec \
     --ignore=tests/engine/test_prefill_memory.py)
fi
echo "total $(( $(date +%s) - T0 )) s"
