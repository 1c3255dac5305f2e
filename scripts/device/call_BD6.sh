#!/usr/bin/env bash
# Device call BD6 (session 37; carry .whl and .dev/libexl2_kernels.so.gz built at e3a2f45, whose csrc/ had the
# switch below; it is removed since; ~160 s). The model of BD2-BD5
# (persistent_bound.cu) put ~0.28 ms of the 8B decode step's layer GEMVs in the split-K finish (the last item of each
# column block waits for its ticket, loads the partials, sums them), and a ticketless fixed-point finish recovered
# ~0.12 ms of it there. The real library, measured: EXL2_GEMV_SKIP_FINISH=1 (a measurement switch, results WRONG)
# stores each split's partial into the output with no ticket and no reduction (q/k/v's fused rope keeps its finish).
#  1. The GEMV GPU tests without the chain's 8B layer tests (the default path gained a branch on a zero flag).
#  2. spec_bench (decode step and verify costs) default / skip, interleaved twice.
export EXL2_CARRIED_LIBRARY=1
source scripts/device/common.sh
begin_call bd6
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader
gpu_tests gemv 170 -n 8 $GEMV_GPU_TESTS -k "not llama3_8b"
echo "elapsed $(( $(date +%s) - T0 )) s"
for round in 1 2; do
  fits 70 "spec default $round" 560 && spec_costs "d$round"
  fits 70 "spec skip $round" 560 && spec_costs "skip$round" EXL2_GEMV_SKIP_FINISH=1
done
echo "elapsed $(( $(date +%s) - T0 )) s"
