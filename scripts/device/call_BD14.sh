#!/usr/bin/env bash
# Device calls BD11, BD13 and BD14 (session 37; carry .whl and .dev/libexl2_kernels.so.gz; ~120 s): the GPU suite
# without SmolLM2 on the session's final library. BD11 (quiet; one chain test failed) and BD13 (all passed) ran it
# before the ticket check existed. For BD14, tests/conftest.py checks after every GPU test that no ticket word is
# left armed (split-K tickets, the chain's barrier arrivals, attention and sampler tickets): BD11's order-dependent
# chain mismatch is what a leaked ticket would look like; a leaking test fails at its teardown.
export EXL2_CARRIED_LIBRARY=1
source scripts/device/common.sh
begin_call bd14
nvidia-smi --query-gpu=name --format=csv,noheader
gpu_tests_verbose cuda 300 -n 8 $CUDA_TESTS_NO_SMOLLM2
echo "total $(( $(date +%s) - T0 )) s"
