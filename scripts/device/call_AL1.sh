#!/usr/bin/env bash
# Device call AL1 (prepared in session 22, not yet run; ~560 s). Carry .whl and .dev/libexl2_kernels.so.gz built from
# the commit that runs (bash scripts/build_variant.sh "" .dev/libexl2_kernels.so.gz).
#  1. Where the engine's decode step loses 53 us against its graph replay (AK3: 423.9 against 433.6 tok/s at 1k):
#     scripts/profile_engine_step.py, GPU busy / idle per step, the device work besides the model, the idle gaps.
#  2. The GEMV GPU tests in full on the scales-first default (AK4 ran 94 of them with it before its limit), then
#     the other GPU tests that need no SmolLM2 in what time is left.
export EXL2_CARRIED_LIBRARY=1
source scripts/device/common.sh
begin_call al1
timeout 120 python3 scripts/profile_engine_step.py --shape llama3-8b --workdir /tmp/models --context 1024 \
  --json "$R/engine_step.json" > "$R/engine_step.txt" 2>&1
head -40 "$R/engine_step.txt" | cut -c1-160
echo "elapsed $(( $(date +%s) - T0 )) s"
gpu_tests_verbose gemv 220 -n 12 $GEMV_GPU_TESTS -k "not llama3_8b"
gpu_tests_verbose gpu_tests "$(left 550)" -n 12 $CUDA_TESTS_NO_SMOLLM2 --deselect tests/kernels/test_exl2_gemm.py
echo "total $(( $(date +%s) - T0 )) s"
