#!/usr/bin/env bash
# Device call Z3 (session 15; carry .whl, .dev/libexl2_kernels.so.gz and .dev/libexl2_kernels_fold4.so.gz): Z1's
# zero-point fold on 4-bit runs only (EXL2_GEMV_FOLD_ZERO=4), where ptxas keeps the M <= 8 kernel spill-free (Z1's
# build for 4/5/6/8 bits spilled and every width ran slower). Build the carried variant with
# `bash scripts/build_variant.sh EXL2_GEMV_FOLD_ZERO=4 .dev/libexl2_kernels_fold4.so.gz`. Steps: the 8B decode step
# at 1k, D / V interleaved twice; the GEMM / GEMV GPU tests with V to the end of the call.
export EXL2_CARRIED_LIBRARY=1
source scripts/device/common.sh
begin_call z3
use_libraries V=.dev/libexl2_kernels_fold4.so.gz
interleaved_steps D1 V1 D2 V2
echo "mean graph steps: D $(mean_step D) V $(mean_step V) ms"
echo "elapsed $(( $(date +%s) - T0 )) s"
cp /tmp/libV.so "$LIB"
gpu_tests_verbose kernV "$(left 200)" -n 14 tests/kernels/test_exl2_gemm.py tests/kernels/test_fold_down_order_cuda.py
cp /tmp/libD.so "$LIB"
echo "total $(( $(date +%s) - T0 )) s"
