#!/usr/bin/env bash
# Device call AQ1 (prepared in session 26, not yet run; ~250 s). Carry .whl and .dev/libexl2_kernels.so.gz built from
# the commit that runs. In AN1 and AP1 (2026-12-05) the tiny-model engine GPU tests (test_lookahead_tiny.py,
# test_sampled_gpu_tiny.py) did not finish their first test in 90-100 s, while `bench` ran the 8B engine, graph I/O
# included, in seconds. Until they pass, graph I/O (AP1: 443.0 engine tok/s at 1k against 432.3 without it in AN1)
# stays off and the GPU sampling path's NaN check is unverified on the GPU.
#  1. scripts/tiny_engine_probe.py: each stage's seconds for vocabularies 4,096 (AL2's batch-invariance model, which
#     passed), 5,000 and 40,000; a stage past 45 s dumps every thread's stack.
#  2. The tiny-model engine tests, one module per worker, with pytest-timeout's stack dump at 120 s.
export EXL2_CARRIED_LIBRARY=1
source scripts/device/common.sh
begin_call aq1
timeout 150 python3 scripts/tiny_engine_probe.py --vocab 4096 5000 40000 --stall 45 > "$R/probe.txt" 2>&1
head -60 "$R/probe.txt" | cut -c1-200
gpu_tests_verbose engine 150 -n 3 --dist loadfile --timeout 120 tests/engine/test_sampled_gpu_tiny.py \
  tests/engine/test_lookahead_tiny.py tests/serve/test_batch_invariance.py
echo "total $(( $(date +%s) - T0 )) s"
