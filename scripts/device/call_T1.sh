#!/usr/bin/env bash
# Device call T1 (session 11; carry .whl and .dev/libexl2_kernels.so.gz, built with the L2 lookahead):
#  1. GPU tests of the lookahead (csrc/quant/exl2_gemv_lookahead.cu: bit-identical GEMVs in every launch form, in a
#     graph, the model forward);
#  2. the lookahead's budget, same call: the 8B decode step at 1k (profile_decode nochain), verify costs and
#     `bench` at 1k / 32k (fp16, q4), EXL2_BACKEND_GEMV_LOOKAHEAD_MB 0 against 16 (and 48 for the decode step);
#  3. ExLlamaV2 0.3.2 at 32k (fp16 and q4 caches) with ours on the same random 8B directory (issue 6's 10x).
export EXL2_CARRIED_LIBRARY=1
source scripts/device/common.sh
begin_call t1
start_exllamav2_jit
gpu_tests lookahead 100 -n 6 tests/kernels/test_gemv_lookahead_cuda.py tests/unit/test_gemv_lookahead.py
echo "tests $(( $(date +%s) - T0 )) s"
for mb in 0 16 48; do
  decode_step_1k "la$mb" nochain EXL2_BACKEND_GEMV_LOOKAHEAD_MB=$mb
  grep -A3 "critical path" "$R/prof_la$mb.txt" | grep gemv_tma | head -1
done
for mb in 0 16; do spec_costs "la$mb" EXL2_BACKEND_GEMV_LOOKAHEAD_MB=$mb; done
echo "steps $(( $(date +%s) - T0 )) s"
for mb in 0 16; do bench_8b "la$mb" 100 1024,32768 fp16,q4 EXL2_BACKEND_GEMV_LOOKAHEAD_MB=$mb; done
echo "bench $(( $(date +%s) - T0 )) s"
if [ "$(left 570)" -gt 100 ]; then
  exllamav2_vs_ours "$(left 570)" --context 32768 --cache-types fp16,q4 --decode-tokens 64
fi
echo "total $(( $(date +%s) - T0 )) s"
