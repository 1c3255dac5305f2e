#!/usr/bin/env bash
# Ran in session 44 (BK1_LIMIT=530, H100); its loops moved into common.sh afterwards (the same steps; the 32k
# benches are now named bench_O1 / bench_D2 instead of bench_32k_O / bench_32k_D).
# Device call BK1 (session 44; carry .whl and .dev; ~540 s). The tensor-core attention over code pages with fewer
# instructions per step of 16 keys, meant to be bit-identical (cuobjdump, q4 staged kernel at D = 128: 704 -> 580
# per step, q8 680 -> 627):
#   - 4-bit codes: (w & mask) | 0x6400 as one lop3 (the compiler emitted two), and the nibbles at bits 4..7 as
#     1024 + 16 c times 1/16 minus 72 (one shift per word instead of three);
#   - the staged kernel's cp.async addresses: a 64-bit step base per region plus 32-bit lane offsets.
# Library N (.dev/libexl2_kernels.so.gz, this commit) against O (.dev/lib_old.so.gz, 453bdb4's):
#  1. outputs bit for bit (scripts/device/attn_bits.py: every cache type, D 64 / 128, decode and verify rows),
#     staged (default) and register kernels (EXL2_ATTN_STAGED=0);
#  2. the attention and KV GPU tests, and the GEMV suites (the rebuilt ABI 13 library's first GPU run);
#  3. the 32k attention alone, q4 / q8, O N O N; `bench` 32k q8 / q4 with each, then 1k / 32k all types with N;
#  4. N at 2 / 4 CTAs per SM and with 3 stages; ncu of the q4 and q8 launches (N) with stalls by code region,
#     as time allows (session 43's BJ2).
export EXL2_CARRIED_LIBRARY=1
source scripts/device/common.sh
begin_call bk1
L=${BK1_LIMIT:-540}
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
use_libraries O=.dev/lib_old.so.gz
attn_bits_against_old auto 0
echo "elapsed $(( $(date +%s) - T0 )) s"
gpu_tests attention 150 -n 8 tests/kernels/test_paged_attention.py tests/kernels/test_paged_attention_stream.py \
  tests/kernels/test_kv_quant_kernels.py tests/kernels/test_prefill_attention.py
echo "elapsed $(( $(date +%s) - T0 )) s"
fits 70 "gemv suites" "$L" && gpu_tests gemv_suites 60 -n 12 $GEMV_GPU_TESTS -k "not llama3_8b"
each_library "$L" 40 "O D O D" attention_sweep_32k q4,q8 3
echo "elapsed $(( $(date +%s) - T0 )) s"
each_library "$L" 110 "O D" bench_8b 110 32768 q8,q4  # $R/bench_<L><n>.txt
fits 140 "bench N" "$L" && bench_8b new 130 1024,32768 fp16,q8,q4
# N's other operating points: CTAs per SM 2 / 4, and 3 stages
fits 40 "sweep N ctas" "$L" && attention_sweep_32k N_ctas q4,q8 2,4
fits 40 "sweep N ns3" "$L" && attention_sweep_32k N_ns3 q4,q8 3,4 EXL2_ATTN_STAGED=3
ncu_attention_stalls "$L" q4 q8
echo "total $(( $(date +%s) - T0 )) s"
