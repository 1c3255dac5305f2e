#!/usr/bin/env bash
# Device call BH1 (session 41; carry .whl, .dev and .gga; ~9 min): gate/up's split-K partials left
# to down's gather (ops/cuda_left.py, EXL2_BACKEND_LEFT_PARTIALS=1, opt-in; session 37's model: -0.06 ms per 8B
# decode step), written without a device:
# 1. its GPU tests (bit-identity with the reduced gate/up at every width, 1-8 rows, both norm routes, a graph, the
#    model forward) and the GEMV suites on this library (the left code is compiled into a kernel of its own: the
#    lean kernels' SASS is instruction for instruction session 40's: cuobjdump, session 41);
# 2. spec_bench's step costs, interleaved twice: default, left (the switch on) and nonorm (session 40's BF7: the
#    verify step without its norm launches, results wrong): decode and verify k = 1 / 2 / 4 / 8; then, if time is
#    left, the decode step's GEMV time by role with and without the switch (profile_decode).
# Keeps the SmolLM2 GGUF's first part in /tmp/smol: BH2 and BH3 follow within 30 s each.
# Carry prepared with: bash scripts/device/prepare_carry.sh
export EXL2_CARRIED_LIBRARY=1
source scripts/device/common.sh
keep_gguf_parts; ls /tmp/smol
begin_call bh1
nvidia-smi --query-gpu=name --format=csv,noheader
gpu_tests left_gemv 230 -n 12 tests/kernels/test_gemv_left.py $GEMV_GPU_TESTS -k "not llama3_8b"
for round in 1 2; do
  fits 150 "spec costs, round $round" || break
  spec_costs "default$round"
  spec_costs "left$round" EXL2_BACKEND_LEFT_PARTIALS=1
  # session 40's BF7, never run: a verify step without its pre-gathering norm launches (results wrong; graph costs
  # only), the ceiling of a producer-side norm
  SPEC_SKIP=engine spec_costs "nonorm$round" EXL2_BACKEND_MEASURE_SKIP_NORM_PREGATHER=1
done
if fits 170 "the decode step by role"; then
  decode_step_1k D nochain; gemv_kinds D
  decode_step_1k left nochain EXL2_BACKEND_LEFT_PARTIALS=1; gemv_kinds left
fi
echo "total $(( $(date +%s) - T0 )) s"
