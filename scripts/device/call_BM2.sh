#!/usr/bin/env bash
# RAN in session 49 (H100): the whole-share ring LOST (decode +1.0% W32, +2.5% W48); the switch is gone (code in
# git at bcc0b9c). docs/performance.md, session 49.
# Device call BM2 (session 49; carry .whl and .dev; BM2_LIMIT seconds (420)): a GEMV ring that holds a block's whole
# share where it is small (EXL2_GEMV_WHOLE_KB, a measurement switch of this library: exl2_gemm.cu). BM1's critical
# path of the 8B decode step at 1k: o_proj 8.87 us per launch of which 2.64 stream its 8.2 MB; its blocks hold 32 KB
# each (4 chunks of 8 KB), the 24 KB ring issues 3 of them before the PDL wait and the 4th only once the first is
# consumed, after the wait. W32 gives o (only) a 32 KB ring, everything in flight while the attention runs; W48 also
# q/k/v (48 KB per block, issued while down finishes).
#  1. the GEMV GPU tests with W48 (other stage counts on the same math: bit-identical outputs expected);
#  2. decode / verify step costs (spec_bench, 8B 4.0 bpw at 1k), D (off) / W32 / W48 interleaved twice;
#  3. the decode step's critical path by role with W32 (o's us per launch against BM1's 8.87);
#  4. `bench` at 1k and 32k, fp16 cache, D and W32 (the 32k attention is what o's early copies overlap there).
export EXL2_CARRIED_LIBRARY=1
source scripts/device/common.sh
begin_call bm2
L=${BM2_LIMIT:-420}
card_and_jit
fits 120 "GEMV tests" "$L" && EXL2_GEMV_WHOLE_KB=48 gpu_tests gemv_w48 110 -n 8 $GEMV_GPU_TESTS -k "not llama3_8b"
echo "tests $(( $(date +%s) - T0 )) s"
fits 180 "spec costs" "$L" && interleaved_spec_costs D W32=EXL2_GEMV_WHOLE_KB=32 W48=EXL2_GEMV_WHOLE_KB=48
echo "sweep $(( $(date +%s) - T0 )) s"
if fits 60 "decode step" "$L"; then
  decode_step_1k w32 nochain EXL2_GEMV_WHOLE_KB=32
  grep -A7 "GEMVs by role on the critical path" "$R/prof_w32.txt" | cut -c1-120
fi
fits 80 "bench" "$L" && { bench_8b d 75 1024,32768 fp16; bench_8b w32 75 1024,32768 fp16 EXL2_GEMV_WHOLE_KB=32; }
echo "total $(( $(date +%s) - T0 )) s"
