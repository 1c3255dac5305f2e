#!/usr/bin/env bash
# Device call Z1 (session 15; carry .whl, .dev/libexl2_kernels.so.gz and .dev/libexl2_kernels_fold.so.gz): the
# zero point out of the TMA GEMV's decode at M <= 8 (EXL2_GEMV_FOLD_ZERO, csrc/quant/exl2_gemv_fold.cuh: bare codes
# as fp16 subnormals, x summed by one more mma per k-step; a 4-bit warp chunk 120 -> 96-98 SASS instructions on
# the path without a group end) against the default (Y1's lean flush, now the code). Build the carried variant
# with `bash scripts/build_variant.sh EXL2_GEMV_FOLD_ZERO .dev/libexl2_kernels_fold.so.gz`. Steps:
#  1. the 8B decode step at 1k, D / Z interleaved twice, GEMV time by role and bit widths;
#  2. bench_gemm --m1 (the widths table) with each library;
#  3. the GEMV GPU tests with Z: its tolerance tests decide whether it may become the code.
export EXL2_CARRIED_LIBRARY=1
source scripts/device/common.sh
begin_call z1
use_libraries Z=.dev/libexl2_kernels_fold.so.gz
interleaved_steps D1 Z1 D2 Z2
for v in D Z; do
  cp "/tmp/lib$v.so" "$LIB"
  timeout 60 python3 scripts/bench_gemm.py --m1 > "$R/m1_$v.txt" 2>&1
  echo "== m1 $v"; grep -E "^M1 " "$R/m1_$v.txt" | head -12 | cut -c1-150
done
echo "mean graph steps: D $(mean_step D) Z $(mean_step Z) ms"
echo "elapsed $(( $(date +%s) - T0 )) s"
cp /tmp/libZ.so "$LIB"
gpu_tests_verbose kernZ "$(left 585)" -n 14 $GEMV_GPU_TESTS -k "not llama3_8b"
cp /tmp/libD.so "$LIB"
echo "total $(( $(date +%s) - T0 )) s"
