#!/usr/bin/env bash
# Device call AL2 (prepared in session 22, extended in 23; ~420 s). Carry .whl and .dev/libexl2_kernels.so.gz built
# from the commit that runs (/tmp/rebuild.sh or bash scripts/build_variant.sh "" .dev/libexl2_kernels.so.gz).
# 1. Eager op calls without the torch.library dispatcher (EXL2_BACKEND_DIRECT_OPS=1, ops/library.py direct_calls): a
#    2k prefill of the 8B makes ~450 custom-op calls at ~20-25 us each, and it is bound by the host (AK1: 65.5 ms
#    of wall time, ~53 ms of kernels). The layer, KV-cache and prefill GPU tests with the switch on; then the 2k
#    prefill (scripts/profile_prefill.py, fp16 and q4 caches) off (D) and on (X), interleaved twice.
# 2. greedy_tokens (session 23): the engine's greedy sampling on the sampler kernel instead of torch.argmax (27 us
#    per 8B step in AL1's profile_engine_step). Its GPU tests and the engine's batch-invariance GPU test; the engine
#    step profile again; bench at 1k (fp16), engine against graph.
export EXL2_CARRIED_LIBRARY=1
source scripts/device/common.sh
begin_call al2
EXL2_BACKEND_DIRECT_OPS=1 gpu_tests direct 120 -n 12 tests/kernels/test_layers.py tests/kernels/test_kv_quant_kernels.py \
  tests/kernels/test_prefill_attention.py tests/engine/test_prefill_memory.py
gpu_tests greedy 60 -n 8 tests/kernels/test_sampling_kernel.py tests/serve/test_batch_invariance.py
for round in 1 2; do
  for v in D X; do
    env $([ $v = X ] && echo EXL2_BACKEND_DIRECT_OPS=1) timeout 90 python3 scripts/profile_prefill.py \
      --shape llama3-8b --workdir /tmp/models --cache-types fp16,q4 --top 8 --json "$R/prefill_$v$round.json" \
      > "$R/prefill_$v$round.txt" 2>&1
    echo "-- $v$round"; grep -E "^== " "$R/prefill_$v$round.txt" | cut -c1-160
  done
done
echo "elapsed $(( $(date +%s) - T0 )) s"
timeout 100 python3 scripts/profile_engine_step.py --shape llama3-8b --workdir /tmp/models --context 1024 \
  --json "$R/engine_step.json" > "$R/engine_step.txt" 2>&1
grep -v Warning "$R/engine_step.txt" | head -24 | cut -c1-160
bench_8b E1k 90 1024 fp16
echo "total $(( $(date +%s) - T0 )) s"
