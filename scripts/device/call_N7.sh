#!/usr/bin/env bash
# Device call N7 (session 9; carry .whl and .dev/libexl2_kernels.so.gz): N6's test run of the layer kernels ran out
# of its 100 s at 60% (all passed so far). The whole of it again, four pytest workers, and the engine-level GPU
# tests that run rope_kv_write and the quantized write through the model (prefill memory, batch invariance).
export EXL2_CARRIED_LIBRARY=1
source scripts/device/common.sh
results_dir
trap '[ -d "$R" ] && pack_results n7' EXIT
t=$(date +%s)
gpu_tests kernels 200 tests/kernels/test_layers.py tests/kernels/test_kv_quant_kernels.py \
  tests/kernels/test_gemv_norm.py tests/engine/test_prefill_memory.py tests/serve/test_batch_invariance.py \
  --timeout 150 -n 4
echo "tests $(( $(date +%s) - t )) s"
