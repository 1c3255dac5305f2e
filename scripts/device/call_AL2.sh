#!/usr/bin/env bash
# Device call AL2 (prepared in session 22, not yet run; ~300 s). Carry .whl and .dev/libexl2_kernels.so.gz built from
# the commit that runs (bash scripts/build_variant.sh "" .dev/libexl2_kernels.so.gz).
# Eager op calls without the torch.library dispatcher (EXL2_BACKEND_DIRECT_OPS=1, ops/library.py direct_calls): a 2k
# prefill of the 8B makes ~450 custom-op calls at ~20-25 us each, and it is bound by the host (AK1: 65.5 ms of wall
# time, ~53 ms of kernels).
#  1. The layer, KV-cache and prefill GPU tests with the switch on.
#  2. The 2k prefill (scripts/profile_prefill.py, fp16 and q4 caches) off (D) and on (X), interleaved twice.
export EXL2_CARRIED_LIBRARY=1
source scripts/device/common.sh
begin_call al2
EXL2_BACKEND_DIRECT_OPS=1 gpu_tests direct 120 -n 12 tests/kernels/test_layers.py tests/kernels/test_kv_quant_kernels.py \
  tests/kernels/test_prefill_attention.py tests/engine/test_prefill_memory.py
for round in 1 2; do
  for v in D X; do
    env $([ $v = X ] && echo EXL2_BACKEND_DIRECT_OPS=1) timeout 90 python3 scripts/profile_prefill.py \
      --shape llama3-8b --workdir /tmp/models --cache-types fp16,q4 --top 8 --json "$R/prefill_$v$round.json" \
      > "$R/prefill_$v$round.txt" 2>&1
    echo "-- $v$round"; grep -E "^== " "$R/prefill_$v$round.txt" | cut -c1-160
  done
done
echo "total $(( $(date +%s) - T0 )) s"
