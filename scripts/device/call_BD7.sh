#!/usr/bin/env bash
# Device call BD7 (session 37; carry .whl and .dev/libexl2_kernels.so.gz; ~150 s). The nucleus sampler's two
# copies of "race a sorted token unless min-p drops it" are one function now (sample_nucleus.cuh race_sorted; the
# sampler's cubin 206,544 -> 206,416 bytes, registers and spills unchanged). Its GPU tests and the sampled engine
# tests, then filter_cost --profile (one 128k row, kernel against torch; AW5 of session 33: top-k 50 72.6 / 137.8 us,
# top-p spread 112.6 / 143.6, the near-uniform row 523.5 / 141.8).
export EXL2_CARRIED_LIBRARY=1
source scripts/device/common.sh
begin_call bd7
nvidia-smi --query-gpu=name --format=csv,noheader
gpu_tests_verbose sampling 150 -n 3 --dist loadfile --timeout 140 tests/kernels/test_sampling_kernel.py \
  tests/engine/test_sampled_lookahead_tiny.py tests/engine/test_sampled_gpu_tiny.py tests/unit/test_filtered_probs_skip.py
echo "elapsed $(( $(date +%s) - T0 )) s"
timeout 60 python3 scripts/filter_cost.py 128256 --profile > "$R/filter_cost.txt" 2>&1; tail -14 "$R/filter_cost.txt"
echo "total $(( $(date +%s) - T0 )) s"
