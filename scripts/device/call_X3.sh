#!/usr/bin/env bash
# Device call X3 (session 14; carry .whl and .dev/libexl2_kernels.so.gz): the session's final library (the one-run
# straight path, instruction for instruction X1's measured build).
#  1. the 8B decode step at 1k, then two attention switches for the next session: every K row of a split sent to
#     L2 before the PDL wait (EXL2_ATTN_QUANT_PREFETCH=5) and split tickets (EXL2_BACKEND_ATTN_TICKETS=1);
#  2. `bench` at 1k and 32k (fp16 / q8 / q4) and verify costs;
#  3. the GEMV GPU tests until 340 s (the session had ~430 s of device time left).
export EXL2_CARRIED_LIBRARY=1
source scripts/device/common.sh
begin_call x3
decode_step_1k final nochain
decode_step_1k kall nochain EXL2_ATTN_QUANT_PREFETCH=5
decode_step_1k tickets nochain EXL2_BACKEND_ATTN_TICKETS=1
attention_paths final kall tickets
echo "elapsed $(( $(date +%s) - T0 )) s"
bench_8b final 130 1024,32768 fp16,q8,q4
spec_costs final
echo "elapsed $(( $(date +%s) - T0 )) s"
gpu_tests_verbose kern "$(left 340)" -n 14 $GEMV_GPU_TESTS -k "not llama3_8b"
echo "total $(( $(date +%s) - T0 )) s"
