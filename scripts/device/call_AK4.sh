#!/usr/bin/env bash
# Device call AK4 (session 22; ~230 s, the session's last budget). Carry .whl and .dev/libexl2_kernels.so.gz built
# from the commit that runs (bash scripts/build_variant.sh "" .dev/libexl2_kernels.so.gz).
# The TMA GEMV's producer warp in two other orders (switches, results unchanged; S became the default after it):
#   S  EXL2_GEMV_SCALES_FIRST=1: the block's group scales staged before the ring's first fill, so the first chunk
#      waits for its slot only, not for the whole fill and then the scales;
#   P  EXL2_GEMV_PREWAIT_SLOTS=1: one ring slot before the PDL wait, the rest after it, so the input stage's loads
#      queue behind less (session 21: they wait behind the ring's copies).
# GEMV GPU tests with both switches on (a subset), then spec_bench D / S / P interleaved twice.
export EXL2_CARRIED_LIBRARY=1
source scripts/device/common.sh
begin_call ak4
EXL2_GEMV_SCALES_FIRST=1 EXL2_GEMV_PREWAIT_SLOTS=1 gpu_tests switches 50 -n 12 tests/kernels/test_exl2_gemm.py \
  tests/kernels/test_gemv_norm.py -k "not llama3_8b and not cluster"
interleaved_spec_costs D S=EXL2_GEMV_SCALES_FIRST=1 P=EXL2_GEMV_PREWAIT_SLOTS=1
echo "total $(( $(date +%s) - T0 )) s"
