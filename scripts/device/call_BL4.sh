#!/usr/bin/env bash
# RAN in session 48 (H100; docs/performance.md, docs/measurements/2026-12-07-session48.json: the default stays).
# Device call BL4 (carry .whl and .dev; BL4_LIMIT seconds (400)): the GEMV ring's tuning again, now that the ring is
# 128-byte aligned. Its settings were chosen on rings 32 bytes into a line (H200 call AJ3: 24 KB in flight best,
# 16-32 KB within 1.4%; H100 call BF3 of session 40: 32 KB +1.8% per decode step; no L2 prefetch past the ring; at
# least 2 slots), and BL2 of session 46 found a ring 16 bytes into a line 7% slower per decode step: misaligned
# copies may have been what made deeper rings lose. No build: the host settings are environment variables the
# library reads once per process (exl2_gemm.cu).
#  1. decode / verify step costs (spec_bench, 8B 4.0 bpw at 1k), interleaved twice: D default (24 KB), K32 / K20 /
#     K40 (EXL2_GEMV_RING_KB), F16 (EXL2_GEMV_PREFETCH_KB=16), S3 (EXL2_GEMV_MIN_STAGES=3).
#  A setting that wins by more than the D-to-D spread becomes the default only after `bench` with and without it.
#  2. On an H200 only (the targets' card; the last H200 figures are session 31's AR1): the closing figures, `bench`
#     8B at 1k and 32k (fp16 / q8 / q4), the verify step costs, ExLlamaV2 beside ours at 1k, as time allows.
export EXL2_CARRIED_LIBRARY=1
source scripts/device/common.sh
begin_call bl4
L=${BL4_LIMIT:-400}
card_and_jit
# BL4_SHORT=1 (a call with little device time left): D, K32 and K40 only (~150 s)
if [ "${BL4_SHORT:-0}" = 1 ]; then
  fits 150 "spec costs" "$L" && interleaved_spec_costs D K32=EXL2_GEMV_RING_KB=32 K40=EXL2_GEMV_RING_KB=40
else
  fits 300 "spec costs" "$L" && interleaved_spec_costs D K32=EXL2_GEMV_RING_KB=32 K20=EXL2_GEMV_RING_KB=20 \
    K40=EXL2_GEMV_RING_KB=40 F16=EXL2_GEMV_PREFETCH_KB=16 S3=EXL2_GEMV_MIN_STAGES=3
fi
echo "sweep $(( $(date +%s) - T0 )) s"
if [ "$h200" = 1 ]; then
  fits 200 "bench" "$L" && { bench_8b final 130 1024,32768 fp16,q8,q4; spec_costs final; }
  [ "$(left "$L")" -gt 90 ] && exllamav2_vs_ours "$(left "$L")"
fi
echo "total $(( $(date +%s) - T0 )) s"
