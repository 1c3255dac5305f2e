#!/usr/bin/env bash
# Device call AC1 (session 16; carry .whl and .dev/libexl2_kernels.so.gz): the session's closing figures, with the
# zero-point fold and the attention combine in o_proj removed (device code instruction-identical to session 15's
# default library) and where the 32k decode attention's time goes:
#  1. ncu of the one-pass attention kernel at 32k (8B attention shape, fp16 and q4 pages): AB1 found the kernel
#     at ~37-50 us per layer for fp16, q8 and q4 alike (2.7 / 1.8 / 1.0 TB/s), so not bound by the bytes it reads;
#  2. the 8B decode step at 32k (fp16 cache) and its critical path;
#  3. `bench` at 1k and 32k (fp16 / q8 / q4), verify costs, then ExLlamaV2 0.3.2 and ours at 32k, fp16 and q4
#     caches (issue 6's 10x; last measured in session 11);
#  4. the attention and engine GPU tests.
export EXL2_CARRIED_LIBRARY=1
source scripts/device/common.sh
begin_call ac1
start_exllamav2_jit
ncu_attention ncu_fp16 fp16
ncu_attention ncu_q4 q4
echo "elapsed $(( $(date +%s) - T0 )) s"
timeout 90 python3 scripts/profile_decode.py --shapes llama3-8b --variants nochain --workdir /tmp/prof \
  --context 32768 --cache-types fp16 --out "$R/p_32k" > "$R/prof_32k.txt" 2>&1
grep -E "^######## " "$R/prof_32k.txt" | cut -c1-140
grep -A12 "critical path" "$R/prof_32k.txt" | head -13 | cut -c1-120
echo "elapsed $(( $(date +%s) - T0 )) s"
final_figures 480 --context 32768 --cache-types fp16,q4 --decode-tokens 64
echo "elapsed $(( $(date +%s) - T0 )) s"
gpu_tests_verbose tests "$(left 585)" -n 12 tests/kernels/test_kv_quant_kernels.py tests/kernels/test_paged_attention.py \
  tests/engine/test_engine.py
echo "total $(( $(date +%s) - T0 )) s"
