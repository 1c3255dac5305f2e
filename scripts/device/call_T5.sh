#!/usr/bin/env bash
# Device call T5 (session 11; carry .whl and .dev/libexl2_kernels.so.gz, the library of T2-T4): after T4, attend's
# rope + KV write moved into DecoderLayer._rope_kv_write (Python only); the GPU tests of that path again: the fused
# rope (kernel and model forward), the fused norm's model forward, batch invariance.
export EXL2_CARRIED_LIBRARY=1
source scripts/device/common.sh
begin_call t5
gpu_tests final 100 -n 6 tests/kernels/test_gemv_rope_kv.py tests/serve/test_batch_invariance.py \
  tests/kernels/test_gemv_norm.py tests/unit/test_rope_paths.py -k "model or invarian or rope"
echo "total $(( $(date +%s) - T0 )) s"
