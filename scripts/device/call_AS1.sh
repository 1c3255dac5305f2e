#!/usr/bin/env bash
# Device call AS1 (session 29; carry .whl and .dev/libexl2_kernels.so.gz; ~250 s; AS1_LIMIT=SECONDS for a shorter limit than 400):
#  1. Speculative decoding on the GPU over small random models (tests/spec/test_spec_gpu_tiny.py): greedy output
#     with n-gram drafts and a draft model (the target itself, and another model) identical to plain decoding, also
#     under penalties, a logit bias, min_tokens and a grammar (session 28's draft proposals under the target's
#     rules had run on the CPU only); seeded rejection sampling repeats.
#  2. If time is left and the card is an H200: `bench` at 1k (fp16), against AR1's 436.3 tok/s with the sampler's
#     NaN / +inf flag now in.
export EXL2_CARRIED_LIBRARY=1
source scripts/device/common.sh
begin_call as1
nvidia-smi --query-gpu=name --format=csv,noheader
gpu_tests_verbose spec_tiny 230 -n 2 tests/spec/test_spec_gpu_tiny.py
echo "elapsed $(( $(date +%s) - T0 )) s"
fits 100 "bench 1k" "${AS1_LIMIT:-400}" && bench_8b D 100 1024 fp16
echo "total $(( $(date +%s) - T0 )) s"
