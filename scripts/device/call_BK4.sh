#!/usr/bin/env bash
# NOT RUN (session 44: four starts failed, then too little device time to start a machine). The code it measures
# was taken back out (af11dcf). To run it: `git show f81f4e2 -- csrc | git apply`, build, pack the library as N
# (scripts/device/pack_library.sh), and carry the current library (1d3265a's csrc) as .dev/lib_a.so.gz and
# 453bdb4's as .dev/lib_old.so.gz.
# Device call BK4 (session 44; carry .whl and .dev; BK4_LIMIT seconds (250), steps in order as time allows;
# BK4_BITS="auto" compares the staged kernels only). After BK1 (the lean code-page attention, bit-identical,
# q4 attention -2.7%): the staged kernel copies its ring's first steps before the PDL wait where the previous
# kernel wrote none of their keys (ncu in BK1: a third of the q4 kernel's stall samples in its prologue and
# epilogue, ~10 steps per warp at 32k). Libraries: N (.dev/libexl2_kernels.so.gz, this commit), A (.dev/lib_a.so.gz,
# BK1's N, 1d3265a), O (.dev/lib_old.so.gz, 453bdb4).
#  1. outputs bit for bit, O against N (scripts/device/attn_bits.py), staged and register kernels;
#  2. the attention / KV GPU tests and the engine tests over quantized pages in captured graphs against the CPU
#     reference (tests/engine/test_staged_attention_engine.py, new), the cache-type and streamed-attention ones;
#  3. the 32k attention alone, q4 / q8, A N A N; `bench` 32k q8 / q4 N then A (as time allows); verify costs A N A N (the verify
#     steps' fp16 pages run the staged kernel with shared row tiles).
export EXL2_CARRIED_LIBRARY=1
source scripts/device/common.sh
begin_call bk4
L=${BK4_LIMIT:-250}
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
use_libraries O=.dev/lib_old.so.gz A=.dev/lib_a.so.gz
for cfg in ${BK4_BITS:-auto 0}; do
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
i=0
for v in A D A D; do
  i=$((i + 1))
  fits 40 "sweep $v$i" "$L" || break
  cp "/tmp/lib$v.so" "$LIB"
  attention_sweep_32k "$v$i" q4,q8 3
done
cp /tmp/libD.so "$LIB"
fits 60 "attention tests" "$L" && gpu_tests attention 60 -n 8 tests/kernels/test_paged_attention.py tests/kernels/test_paged_attention_stream.py \
  tests/kernels/test_kv_quant_kernels.py tests/kernels/test_prefill_attention.py
fits 60 "engine tests" "$L" && gpu_tests engine "$(( $(left "$L") - 5 ))" -n 4 tests/engine/test_staged_attention_engine.py tests/engine/test_stream_attention_engine.py \
  tests/engine/test_cache_types.py tests/engine/test_prefill_memory.py tests/serve/test_batch_invariance.py
echo "elapsed $(( $(date +%s) - T0 )) s"
i=0
for v in A D A D; do
  i=$((i + 1))
  fits 40 "spec $v$i" "$L" || break
  cp "/tmp/lib$v.so" "$LIB"
  spec_costs "$v$i" > /dev/null
  echo "spec $v$i: $(grep -o 'decode [0-9.]* ms, verify ratio.*' "$R/spec_$v$i.log" | head -1)"
done
for v in D A; do
  fits 110 "bench 32k $v" "$L" || break
  cp "/tmp/lib$v.so" "$LIB"
  bench_8b "32k_$v" 110 32768 q8,q4
done
cp /tmp/libD.so "$LIB"
echo "total $(( $(date +%s) - T0 )) s"
