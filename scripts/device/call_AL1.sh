#!/usr/bin/env bash
# Device call AL1 (prepared in session 22, not yet run; ~560 s). Carry .whl and .dev with two libraries built from
# the commit that runs:
#     bash scripts/build_variant.sh "" .dev/libexl2_kernels.so.gz          # the default library
#     bash scripts/build_variant.sh EXL2_GEMV_GROUP32_FAST .dev/libexl2_kernels_g32.so.gz
#  1. Where the engine's decode step loses 53 us against its graph replay (AK3: 423.9 against 433.6 tok/s at 1k):
#     scripts/profile_engine_step.py, GPU busy / idle per step, the device work besides the model, the idle gaps.
#  2. The group-end fast path for 32-row groups (measurement build G, exl2_gemv.cuh gv_unit_group32: no accumulator
#     clearing, no branch; the 4-bit chunk of two such units 103 SASS instructions against ~118): its GEMV tests
#     (bit-identical to the default), then spec_bench D / G interleaved twice. AK1's timeline: in the 8B's 4-bit
#     layers up_proj (groups of 32 rows) streams 16.0-17.4 us against gate's (groups of 128) 14.1-15.1.
#     With them the weight ring at 32 and 16 KB (EXL2_GEMV_RING_KB): AJ3's optimum (24 KB) was measured with the
#     scales staged after the ring's first fill, before they came first (AK4).
#  3. The GEMV GPU tests on the scales-first default (AK4 ran 94 of them with it before its limit), in what time is
#     left.
export EXL2_CARRIED_LIBRARY=1
source scripts/device/common.sh
begin_call al1
use_libraries G=.dev/libexl2_kernels_g32.so.gz
timeout 110 python3 scripts/profile_engine_step.py --shape llama3-8b --workdir /tmp/models --context 1024 \
  --json "$R/engine_step.json" > "$R/engine_step.txt" 2>&1
head -40 "$R/engine_step.txt" | cut -c1-160
cp /tmp/libG.so "$LIB"
gpu_tests_verbose g32 70 -n 12 tests/kernels/test_exl2_gemm.py tests/kernels/test_gemv_norm.py \
  -k "not llama3_8b and not cluster"
for round in 1 2; do
  cp /tmp/libD.so "$LIB"; spec_costs D$round
  cp /tmp/libG.so "$LIB"; spec_costs G$round
  cp /tmp/libD.so "$LIB"; spec_costs R32_$round EXL2_GEMV_RING_KB=32; spec_costs R16_$round EXL2_GEMV_RING_KB=16
done
echo "elapsed $(( $(date +%s) - T0 )) s"
gpu_tests_verbose gemv "$(left 555)" -n 12 $GEMV_GPU_TESTS -k "not llama3_8b"
echo "total $(( $(date +%s) - T0 )) s"
