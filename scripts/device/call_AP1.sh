#!/usr/bin/env bash
# Device call AP1 (session 26; carry .whl and .dev/libexl2_kernels.so.gz built from the commit that runs; ~290 s of the
# session's last 400 s of device time). AN1 found every launch of the streamed attention refused ("too many
# resources requested for launch"): its G = 4 kernels had ~210 registers under __maxnreg__(224), and a CTA of 9 warps
# puts 3 on one SM sub-partition, whose 16K registers then hold at most 168 per thread. Now __launch_bounds__(288, 1)
# (G = 4 spills ~280 bytes). AN1's graph tests were cut by their 90 s limit after 18 passed.
#  1. The streamed kernel's GPU tests.
#  2. The engine's tiny-model GPU tests (sampled decode with the NaN check, lookahead, graph I/O), each result named.
#  3. Where 1 passed: attention_sweep at 32k at the streamed kernel's automatic split (AN1 has the default routes'
#     cells) and bench fp16 1k / 32k with it (AN1: D 432.3 / 264.9 tok/s). Then bench fp16 1k with graph I/O. Each
#     step only where its timeout fits before AP1_LIMIT (290 s).
export EXL2_CARRIED_LIBRARY=1
source scripts/device/common.sh
begin_call ap1
S=EXL2_BACKEND_ATTN_STREAM=1
L=${AP1_LIMIT:-290}  # seconds the call may take (what the session's device time leaves)
gpu_tests_verbose stream 60 -n 12 tests/kernels/test_paged_attention_stream.py tests/kernels/test_paged_attention.py \
  tests/kernels/test_kv_quant_kernels.py -k "stream or Stream or streamed or bad_kernel_codes"
echo "elapsed $(( $(date +%s) - T0 )) s"
# the engine's GPU tests on tiny models: one module per worker (each builds its model and graphs once)
fits 100 "engine tests" "$L" && gpu_tests_verbose engine 100 -n 3 --dist loadfile tests/engine/test_sampled_gpu_tiny.py \
  tests/engine/test_lookahead_tiny.py tests/kernels/test_decode_io_kernel.py
echo "elapsed $(( $(date +%s) - T0 )) s"
# the streamed kernel's figures only where its tests passed
if ! grep -qE "FAILED|ERROR" "$R/stream.txt"; then
  fits 50 "sweep s32k" "$L" && { env $S timeout 50 python3 scripts/attention_sweep.py --context 32768 \
    --types fp16,q8,q4 --splits 0 --json "$R/sweep_s32k.json" > "$R/sweep_s32k.txt" 2>&1
    grep -hE "splits [0-9]|Error" "$R/sweep_s32k.txt"; }
  fits 75 "bench S" "$L" && bench_8b S 75 1024,32768 fp16 $S
fi
fits 50 "bench IO" "$L" && bench_8b IO 50 1024 fp16 EXL2_BACKEND_GRAPH_IO=1
echo "total $(( $(date +%s) - T0 )) s"
