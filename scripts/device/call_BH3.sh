#!/usr/bin/env bash
# Device call BH3 (session 41; BH1/BH2's warm machine; carry .ggc; ~8 min): the GGUF reassembled, the default model
# built (CPU), then the cuda-marked tests that need SmolLM2 (greedy parity of the GPU path against the reference,
# lookahead, speculation exactness; session 39's 52), which sessions 40 and 41 could not run on their libraries
# (session 40: the lazy running max in the attention SmolLM2 decodes with); then the engine and speculation tests
# again with gate/up's partials left to down (EXL2_BACKEND_LEFT_PARTIALS=1).
export EXL2_SKIP_BUILD=1
source scripts/device/common.sh
begin_call bh3
smollm2_gpu_tests
if fits 130 "the engine tests with the left partials"; then
  (export EXL2_BACKEND_LEFT_PARTIALS=1; gpu_tests_verbose cuda_left_engine 120 -n 4 tests/engine tests/spec \
     --ignore=tests/engine/test_prefill_memory.py)
fi
echo "total $(( $(date +%s) - T0 )) s"
