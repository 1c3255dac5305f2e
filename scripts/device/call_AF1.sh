#!/usr/bin/env bash
# Device call AF1 (session 17; carry .whl and .dev/libexl2_kernels.so.gz; ~450 s): the staged one-pass attention as
# the default for code pages. AE1 (`bench`, 8B, register / EXL2_ATTN_STAGED=2, twice each) measured at 32k q8 288.1 /
# 298.4 tok/s, q4 296.2 / 309.7, fp16 259.8 / 249.6, at 1k all three 0.4-1.6% slower staged. The stages are now
# chosen in Python and passed with each launch (C ABI 9), so the tests cover every kernel in one process.
#  1. the attention GPU tests: the fixtures now run staged 2 / 3 beside the register variants, the bit-identity
#     test compares register variants 1 and 2, 2 and 3 stages and auto at explicit splits (AE1's failure was the
#     automatic splits, which follow each kernel's CTA target), and the library refuses bad stage codes;
#  2. `bench` with the new defaults at 1k / 8k / 32k (fp16, q8, q4);
#  3. fp8 and q6 (never run staged) and q8 / q4 at 8k and 32k, register (EXL2_ATTN_STAGED=0) against auto,
#     interleaved twice.
export EXL2_CARRIED_LIBRARY=1
source scripts/device/common.sh
begin_call af1
gpu_tests_verbose attn 220 -n 12 tests/kernels/test_kv_quant_kernels.py tests/kernels/test_paged_attention.py \
  tests/unit/test_attention_planning.py
echo "elapsed $(( $(date +%s) - T0 )) s"
bench_8b auto 150 1024,8192,32768 fp16,q8,q4
echo "elapsed $(( $(date +%s) - T0 )) s"
bench_8b reg1 80 8192,32768 fp8,q6,q8,q4 EXL2_ATTN_STAGED=0
bench_8b auto1 80 8192,32768 fp8,q6,q8,q4
if [ "$(left 520)" -gt 120 ]; then
  bench_8b reg2 80 8192,32768 fp8,q6,q8,q4 EXL2_ATTN_STAGED=0
  bench_8b auto2 80 8192,32768 fp8,q6,q8,q4
fi
echo "total $(( $(date +%s) - T0 )) s"
