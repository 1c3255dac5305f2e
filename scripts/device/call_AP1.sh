#!/usr/bin/env bash
# Device call AP1 (session 26; carry .whl and .dev/libexl2_kernels.so.gz built from the commit that runs; ~360 s of the
# session's last 490 s of device time). AN1 found every launch of the streamed attention refused ("too many
# resources requested for launch"): its G = 4 kernels had ~210 registers under __maxnreg__(224), and a CTA of 9 warps
# puts 3 on one SM sub-partition, whose 16K registers then hold at most 168 per thread. Now __launch_bounds__(288, 1)
# (G = 4 spills ~280 bytes). AN1's graph tests were cut by their 90 s limit after 18 passed.
#  1. The streamed kernel's GPU tests; where they pass, attention_sweep at 32k at its automatic split (AN1 has the
#     default routes' cells) and bench fp16 1k / 32k with it (AN1: D 432.3 / 264.9 tok/s).
#  2. The engine's tiny-model GPU tests (lookahead, graph I/O, sampled decode with the NaN check), each result named.
#  3. bench fp16 1k with graph I/O; q8 / q4 at 32k with the streamed kernel. Each step only where its timeout fits
#     before 360 s.
export EXL2_CARRIED_LIBRARY=1
source scripts/device/common.sh
begin_call ap1
S=EXL2_BACKEND_ATTN_STREAM=1
gpu_tests_verbose stream 60 -n 12 tests/kernels/test_paged_attention_stream.py tests/kernels/test_paged_attention.py \
  tests/kernels/test_kv_quant_kernels.py -k "stream or Stream or streamed or bad_kernel_codes"
# the streamed kernel's figures only where its tests passed; the engine's tests either way
if ! grep -qE "FAILED|ERROR" "$R/stream.txt"; then
  fits 60 "sweep s32k" 360 && { env $S timeout 60 python3 scripts/attention_sweep.py --context 32768 \
    --types fp16,q8,q4 --splits 0 --json "$R/sweep_s32k.json" > "$R/sweep_s32k.txt" 2>&1
    grep -hE "splits [0-9]|Error" "$R/sweep_s32k.txt"; }
  fits 75 "bench S" 360 && bench_8b S 75 1024,32768 fp16 $S
fi
echo "elapsed $(( $(date +%s) - T0 )) s"
gpu_tests_verbose engine 130 -n 6 tests/engine/test_lookahead_tiny.py tests/engine/test_sampled_gpu_tiny.py \
  tests/kernels/test_decode_io_kernel.py
echo "elapsed $(( $(date +%s) - T0 )) s"
fits 50 "bench IO" 360 && bench_8b IO 50 1024 fp16 EXL2_BACKEND_GRAPH_IO=1
fits 90 "bench Sq" 360 && bench_8b Sq 90 32768 q8,q4 $S
echo "total $(( $(date +%s) - T0 )) s"
