#!/usr/bin/env bash
# Device call T2 (session 11; carry .whl and .dev/libexl2_kernels.so.gz, built with RoPE inside the q/k/v GEMV):
#  1. GPU tests of the fused rope (csrc/quant/exl2_gemv_rope.cuh: bit-identical to the GEMV + rope_kv_write, graph
#     replay, the model forward) and of batch invariance;
#  2. same call, EXL2_BACKEND_ROPE_IN_GEMV=1 (default) against 0: the 8B decode step at 1k (profile_decode nochain),
#     verify costs, `bench` at 1k and 32k (fp16 cache);
#  3. the rest of the GPU tests that need no SmolLM2 (session 10's runs never finished their lists), verbose.
export EXL2_CARRIED_LIBRARY=1
source scripts/device/common.sh
begin_call t2
gpu_tests rope 100 -n 6 tests/kernels/test_gemv_rope_kv.py tests/unit/test_rope_in_gemv_args.py \
  tests/serve/test_batch_invariance.py
echo "tests $(( $(date +%s) - T0 )) s"
for v in "on" "off EXL2_BACKEND_ROPE_IN_GEMV=0"; do
  set -- $v; name=$1; shift
  decode_step_1k "rope_$name" nochain "$@"
  grep -A8 "critical path" "$R/prof_rope_$name.txt" | grep -E "gemv_tma|rope_kv|TOTAL" | head -3
done
spec_costs rope_on
spec_costs rope_off EXL2_BACKEND_ROPE_IN_GEMV=0
bench_8b rope_on 90 1024,32768 fp16
bench_8b rope_off 90 1024,32768 fp16 EXL2_BACKEND_ROPE_IN_GEMV=0
echo "steps $(( $(date +%s) - T0 )) s"
timeout "$(left 575)" python3 -m pytest $CUDA_TESTS_NO_SMOLLM2 -m cuda -p no:cacheprovider -n 6 -v --durations=30 \
  -k "not (rope_kv or invarian)" > "$R/rest.txt" 2>&1
grep -cE " PASSED " "$R/rest.txt" | sed "s/^/rest passed: /"
grep -E " FAILED | ERROR |^FAILED|^ERROR|[0-9]+ (passed|failed)" "$R/rest.txt" | tail -8
echo "total $(( $(date +%s) - T0 )) s"
