#!/usr/bin/env bash
# Device call BF5 (session 40; carry .whl and .dev; ~7 min): every cuda-marked test on this session's final
# library (the lazy running max, the norm's xmap entries before its wait), 12 workers; the tests that need the
# default model's GGUF (SmolLM2, 98 MB, past one call's carry) skip. BF2 and BF3 ran the kernel and GEMV suites.
export EXL2_CARRIED_LIBRARY=1
source scripts/device/common.sh
begin_call bf5
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
gpu_tests_verbose all 480 -n 12 tests
grep -cE " SKIPPED" "$R/all.txt" | sed 's/^/skipped: /'
echo "total $(( $(date +%s) - T0 )) s"
