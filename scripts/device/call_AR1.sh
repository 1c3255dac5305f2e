#!/usr/bin/env bash
# Device call AR1 (session 27; ~560 s). Carry .whl (with exllamav2 0.3.2 and openai's wheels) and
# .dev/libexl2_kernels.so.gz built from the commit that runs. AQ1 (H100, this session) passed the tiny-model engine
# GPU tests, graph I/O included (6 in 105 s: AN1 / AP1 had stopped them at 90-100 s, they were slow, not hung), so
# graph I/O is now the default (EXL2_BACKEND_GRAPH_IO=0 turns it off).
#  1. The engine's tiny-model GPU tests (the lookahead with and without graph I/O, the default switch, sampled
#     decode with the NaN check), the sampler and decode-io kernels, and batch invariance through the server.
#  2. The session's figures with graph I/O on by default: bench at 1k and 32k (fp16 / q8 / q4) and verify costs.
#  3. ExLlamaV2 0.3.2 beside ours on the same random 8B directory: 1k (fp16), then 32k (fp16, q4) as time allows.
export EXL2_CARRIED_LIBRARY=1
source scripts/device/common.sh
begin_call ar1
start_exllamav2_jit
nvidia-smi --query-gpu=name,memory.total,clocks.max.memory --format=csv,noheader
gpu_tests_verbose engine 150 -n 4 --dist loadfile --timeout 140 tests/engine/test_sampled_gpu_tiny.py \
  tests/engine/test_lookahead_tiny.py tests/kernels/test_decode_io_kernel.py tests/kernels/test_sampling_kernel.py \
  tests/serve/test_batch_invariance.py
echo "elapsed $(( $(date +%s) - T0 )) s"
bench_8b final 130 1024,32768 fp16,q8,q4
grep -E "^prefill|read bandwidth|graph_io|greedy graph" "$R/bench_final.txt" | head -6
spec_costs final
echo "elapsed $(( $(date +%s) - T0 )) s"
fits 150 "exllamav2 1k" 570 && exllamav2_vs_ours "$(left 420)"
[ -f "$R/exl_compare.txt" ] && { mv "$R/exl_compare.txt" "$R/exl_compare_1k.txt"
  mv "$R/exllamav2_compare.json" "$R/exllamav2_compare_1k.json" 2>/dev/null; }
echo "elapsed $(( $(date +%s) - T0 )) s"
fits 60 "exllamav2 32k" 570 && exllamav2_vs_ours "$(left 570)" --context 32768 --cache-types fp16,q4 --decode-tokens 64
echo "total $(( $(date +%s) - T0 )) s"
