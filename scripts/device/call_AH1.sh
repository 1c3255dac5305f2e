#!/usr/bin/env bash
# Device call AH1 (prepared in session 18, not run; carry .whl, .dev/libexl2_kernels.so.gz and
# .dev/libexl2_kernels_spec.so.gz; ~400 s). AG1 / AG2 found that code compiled into the one TMA GEMV kernel but not
# run slowed every launch ~0.6 us (the 8B decode step 2.29 -> 2.36-2.38 ms). The converse: the measurement build
# EXL2_GEMV_SPECIALIZED (exl2_gemv_tma.cu; built here with -DEXL2_GEMV_SPECIALIZED and carried as
# libexl2_kernels_spec) adds GEMV instantiations compiled with only the features a launch uses (kF* in
# exl2_gemv.cuh: o_proj plain, down gated, gate/up and the head with the fused norm, q/k/v with norm and rope, and
# the verify's pre-gathered sets), chosen at run time with EXL2_GEMV_SPECIALIZED=1 for M <= 16. The kFAll kernels
# are instruction-identical to session 17's (nvdisasm), so the default library is unchanged.
#  1. verify / decode step costs interleaved twice: default library (D), the measurement library with the switch
#     (S) and without it (G: its kFAll kernels, which should equal D);
#  2. the GEMV, fused norm and fused rope GPU tests with the measurement library and the switch on;
#  3. if S wins by more than the runs' spread: `bench` at 1k with it.
export EXL2_CARRIED_LIBRARY=1
source scripts/device/common.sh
begin_call ah1
use_libraries S=.dev/libexl2_kernels_spec.so.gz
for round in 1 2; do
  cp /tmp/libD.so "$LIB"; spec_costs D$round
  cp /tmp/libS.so "$LIB"; spec_costs S$round EXL2_GEMV_SPECIALIZED=1
  spec_costs G$round
done
echo "elapsed $(( $(date +%s) - T0 )) s"
cp /tmp/libS.so "$LIB"
export EXL2_GEMV_SPECIALIZED=1
gpu_tests_verbose spec_tests 170 -n 12 tests/kernels/test_exl2_gemm.py tests/kernels/test_gemv_norm.py \
  tests/kernels/test_gemv_rope_kv.py tests/kernels/test_fold_down_order_cuda.py
unset EXL2_GEMV_SPECIALIZED
echo "elapsed $(( $(date +%s) - T0 )) s"
if [ "$(left 400)" -gt 60 ]; then bench_8b spec "$(left 395)" 1024 fp16 EXL2_GEMV_SPECIALIZED=1; fi
cp /tmp/libD.so "$LIB"
echo "total $(( $(date +%s) - T0 )) s"
