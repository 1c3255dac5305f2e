#!/usr/bin/env bash
# Device call AX2 (session 33; carry .whl (with exllamav2 0.3.2, ninja, sentencepiece, pillow, rich) and
# .dev/libexl2_kernels.so.gz; ~565 s). AX1 (H100) passed the tensor-core streamed attention's tests (250) and
# measured it faster everywhere, so it is now the default for fp16 decode steps over 8 kv heads; the two streamed
# kernels now share attn_stream_ring.cuh.
#  1. The streamed kernels' GPU tests on the refactored library, and the engine through the new default
#     (tests/engine/test_stream_attention_engine.py: teacher-forced logits against the CPU reference).
#  2. The session's figures at the new default: bench 1k / 32k (fp16 / q8 / q4), verify costs.
#  3. ExLlamaV2 0.3.2 beside ours at 32k (fp16, q4: issue 6's 10x), verify costs, then as time allows the 1k
#     attention by the streamed kernel's shortest split (16 / 32 / 64 keys: fewer CTAs, fewer partials to reduce) and
#     ExLlamaV2 at 1k.
export EXL2_CARRIED_LIBRARY=1
source scripts/device/common.sh
begin_call ax2
start_exllamav2_jit
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
L=${AX2_LIMIT:-565}  # seconds the call may take (what the session's device time leaves)
gpu_tests_verbose stream 90 -n 12 tests/kernels/test_paged_attention_stream.py tests/kernels/test_paged_attention.py \
  tests/kernels/test_kv_quant_kernels.py tests/engine/test_stream_attention_engine.py \
  -k "stream or Stream or streamed or tensor_core or bad_kernel_codes"
echo "elapsed $(( $(date +%s) - T0 )) s"
bench_8b final 130 1024,32768 "${AX2_TYPES:-fp16,q8,q4}"
grep -E "^prefill|read bandwidth" "$R/bench_final.txt" | head -3
echo "elapsed $(( $(date +%s) - T0 )) s"
fits 100 "exllamav2 32k" "$L" && exllamav2_vs_ours "$(left "$((L - 65))")" --context 32768 --cache-types fp16,q4 --decode-tokens 64
[ -f "$R/exl_compare.txt" ] && { mv "$R/exl_compare.txt" "$R/exl_compare_32k.txt"
  mv "$R/exllamav2_compare.json" "$R/exllamav2_compare_32k.json" 2>/dev/null; }
echo "elapsed $(( $(date +%s) - T0 )) s"
fits 60 "spec costs" "$L" && spec_costs final
for m in 16 32 64; do
  fits 30 "sweep 1k min_split $m" "$L" && { EXL2_BACKEND_ATTN_STREAM_MIN_SPLIT=$m timeout 30 python3 \
    scripts/attention_sweep.py --context 1024 --types fp16 --splits 0 > "$R/sweep_1k_m$m.txt" 2>&1
    echo "-- 1k, min split $m: $(grep -hE "splits|Error" "$R/sweep_1k_m$m.txt" | tr '\n' ' ' | cut -c1-160)"; }
done
fits 80 "exllamav2 1k" "$L" && exllamav2_vs_ours "$(left "$L")"
echo "total $(( $(date +%s) - T0 )) s"
