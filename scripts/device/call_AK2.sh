#!/usr/bin/env bash
# Device call AK2 (session 22; ~540 s). Carry .whl and .dev with two libraries built from the commit that runs:
#     bash scripts/build_variant.sh "" .dev/libexl2_kernels.so.gz          # the default library
#     bash scripts/build_variant.sh EXL2_GEMV_TIMELINE .dev/libexl2_kernels_timeline.so.gz
#  1. The MLP's flag pair (ops/cuda_mlp_pair.py, csrc/quant/exl2_gemv_flags.cuh: down's blocks poll gate/up's ready
#     flags instead of the PDL wait): its GPU tests first (bit-identity with the two ops, back to back, in a graph,
#     the model forward on and off).
#  2. The 8B decode step and verify costs with the pair off (D) and on (P, EXL2_BACKEND_MLP_FLAGS=1), interleaved
#     twice (spec_bench).
#  3. The GEMV timeline with the pair on: when down's blocks start against gate/up's last column block.
#  4. `bench` at 1k and 32k (fp16, q4) with the pair on.
#  5. The GEMV GPU tests (the gated gather now loads through L2; every launch carries the flags' code), in what
#     time is left.
export EXL2_CARRIED_LIBRARY=1
source scripts/device/common.sh
begin_call ak2
use_libraries T=.dev/libexl2_kernels_timeline.so.gz
gpu_tests_verbose pair 150 tests/kernels/test_mlp_pair.py
for round in 1 2; do
  spec_costs D$round
  spec_costs P$round EXL2_BACKEND_MLP_FLAGS=1
done
cp /tmp/libT.so "$LIB"
EXL2_BACKEND_MLP_FLAGS=1 timeout 80 python3 scripts/gemv_timeline.py --workdir /tmp/models \
  --json "$R/timeline_pair.json" --raw "$R/timeline_pair.npz" > "$R/timeline_pair.txt" 2>&1
cp /tmp/libD.so "$LIB"
tail -16 "$R/timeline_pair.txt"
echo "elapsed $(( $(date +%s) - T0 )) s"
bench_8b pair 130 1024,32768 fp16,q4 EXL2_BACKEND_MLP_FLAGS=1
echo "elapsed $(( $(date +%s) - T0 )) s"
gpu_tests_verbose gemv "$(left 540)" -n 12 $GEMV_GPU_TESTS -k "not llama3_8b and not cluster"
echo "total $(( $(date +%s) - T0 )) s"
