#!/usr/bin/env bash
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
for cfg in auto 0; do
  for v in O D; do
    cp "/tmp/lib$v.so" "$LIB"
    EXL2_ATTN_STAGED=$cfg timeout 60 python3 scripts/device/attn_bits.py --out "/tmp/bits_${v}_$cfg.pt" \
      > "$R/bits_${v}_$cfg.txt" 2>&1 || tail -5 "$R/bits_${v}_$cfg.txt"
  done
  echo "== bits, EXL2_ATTN_STAGED=$cfg (O against N)"
  python3 scripts/device/attn_bits.py --compare "/tmp/bits_O_$cfg.pt" "/tmp/bits_D_$cfg.pt" > "$R/bits_cmp_$cfg.txt" 2>&1
  tail -6 "$R/bits_cmp_$cfg.txt"
done
cp /tmp/libD.so "$LIB"
echo "elapsed $(( $(date +%s) - T0 )) s"
gpu_tests attention 150 -n 8 tests/kernels/test_paged_attention.py tests/kernels/test_paged_attention_stream.py \
  tests/kernels/test_kv_quant_kernels.py tests/kernels/test_prefill_attention.py
echo "elapsed $(( $(date +%s) - T0 )) s"
fits 70 "gemv suites" "$L" && gpu_tests gemv_suites 60 -n 12 $GEMV_GPU_TESTS -k "not llama3_8b"
i=0
for v in O D O D; do
  i=$((i + 1))
  fits 40 "sweep $v$i" "$L" || break
  cp "/tmp/lib$v.so" "$LIB"
  attention_sweep_32k "$v$i" q4,q8 3
done
cp /tmp/libD.so "$LIB"
echo "elapsed $(( $(date +%s) - T0 )) s"
for v in O D; do
  fits 110 "bench 32k $v" "$L" || break
  cp "/tmp/lib$v.so" "$LIB"
  bench_8b "32k_$v" 110 32768 q8,q4
done
cp /tmp/libD.so "$LIB"
fits 140 "bench N" "$L" && bench_8b new 130 1024,32768 fp16,q8,q4
# N's other operating points: CTAs per SM 2 / 4, and 3 stages
fits 40 "sweep N ctas" "$L" && attention_sweep_32k N_ctas q4,q8 2,4
fits 40 "sweep N ns3" "$L" && attention_sweep_32k N_ns3 q4,q8 3,4 EXL2_ATTN_STAGED=3
for ct in q4 q8; do
  fits 90 "ncu $ct" "$L" || continue
  ncu_attention "ncu_attn_$ct" "$ct"
  python3 scripts/ncu_stalls.py "$R/ncu_attn_$ct.sass.csv.gz" --top 10 --bucket 60 > "$R/ncu_attn_$ct.stalls.txt" 2>&1
  head -16 "$R/ncu_attn_$ct.stalls.txt" | cut -c1-160
done
echo "total $(( $(date +%s) - T0 )) s"
