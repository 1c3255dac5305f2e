#!/usr/bin/env bash
# Device call BS4: the GPU tests past the GEMV's own (BS2 ran those, 425 passed) on main with down's gated input by
# 8-byte vectors (csrc ef2d49a0e154, carried as .dev/libexl2_kernels.so.gz): the layer forwards, batch invariance,
# prefill memory and the device converter. Carry .whl and .dev. BS4_LIMIT seconds (190).
export EXL2_CARRIED_LIBRARY=1
source scripts/device/common.sh
begin_card_call bs4 "${BS4_LIMIT:-190}"
fits 100 "model-level GPU tests" "$L" && gpu_tests_verbose model $(( $(left "$L") - 25 )) -n 8 tests/kernels/test_layers.py \
  tests/serve/test_batch_invariance.py tests/engine/test_prefill_memory.py tests/unit/test_convert_device.py \
  tests/kernels/test_fold_down_order_cuda.py
echo "total $(( $(date +%s) - T0 )) s"
