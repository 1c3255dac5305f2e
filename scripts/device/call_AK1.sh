#!/usr/bin/env bash
# Device call AK1 (prepared in session 21, not yet run; ~560 s). Carry .whl and .dev with two libraries built from
# the commit that runs:
#     bash scripts/build_variant.sh "" .dev/libexl2_kernels.so.gz          # the default library
#     bash scripts/build_variant.sh EXL2_GEMV_TIMELINE .dev/libexl2_kernels_timeline.so.gz
#  1. The cluster split-K fix of session 21 (its compute warps meet before writing partials into the ring; AJ3 found
#     the race with the 24 KB ring): the cluster tests first, then the rest of the GEMV tests. With them the prefill
#     over quantized caches, which since session 21 really runs the KV page dequantization kernel (dispatch had
#     never found it: ops/cuda.py did not export dequantize_pages), and the kernel's bit-exactness tests.
#  1b. The 2k prefill of the 8B per cache type (scripts/profile_prefill.py): AJ1 ran the torch-op dequantization
#     (fp16 / q8 / q4 86 / 93 / 151 ms wall, ~53 / ~58 / ~60 ms of kernels).
#  2. The decode step's GEMV timeline with its raw stamps kept (--raw, .npz): which blocks set each launch's end.
#     AJ2 / AJ3: gate/up's slowest block streams 18.4 us against a ~15 us median whatever the SMs' load; the head's
#     second wave leaves 61 us after its median block.
#  3. The head in more, shorter items (EXL2_BACKEND_GEMV_MULTIWAVE_KSPLIT=2 / 4: two or four equal-byte splits per
#     column block where the column blocks outnumber one wave; its GPU test first), spec_bench interleaved twice.
#  4. The README's pytest-benchmark compare against the session-20 baseline (the ring is 24 KB since session 21).
#  5. The GPU tests that need no SmolLM2, in what time is left.
export EXL2_CARRIED_LIBRARY=1
source scripts/device/common.sh
begin_call ak1
use_libraries T=.dev/libexl2_kernels_timeline.so.gz
gpu_tests first 120 tests/kernels/test_exl2_gemm.py tests/kernels/test_kv_quant_kernels.py \
  -k "cluster or multiwave or prefill or dequantize_pages"
timeout 150 python3 scripts/profile_prefill.py --shape llama3-8b --workdir /tmp/models --cache-types fp16,q8,q4 \
  --top 20 --json "$R/profile_prefill.json" > "$R/profile_prefill.txt" 2>&1
grep -E "^== " "$R/profile_prefill.txt" | cut -c1-160
cp /tmp/libT.so "$LIB"
timeout 80 python3 scripts/gemv_timeline.py --workdir /tmp/models --json "$R/timeline.json" --raw "$R/timeline.npz" \
  > "$R/timeline.txt" 2>&1
cp /tmp/libD.so "$LIB"
tail -16 "$R/timeline.txt"
for round in 1 2; do
  spec_costs D$round
  spec_costs K2_$round EXL2_BACKEND_GEMV_MULTIWAVE_KSPLIT=2
  spec_costs K4_$round EXL2_BACKEND_GEMV_MULTIWAVE_KSPLIT=4
done
bench_suite suite_compare 120 --benchmark-storage=file://docs/measurements/benchmarks --benchmark-compare=0001 \
  --benchmark-compare-fail=median:10%
echo "elapsed $(( $(date +%s) - T0 )) s"
gpu_tests_verbose gemv 200 -n 12 $GEMV_GPU_TESTS -k "not llama3_8b and not cluster"
gpu_tests_verbose gpu_tests "$(left 560)" -n 12 $CUDA_TESTS_NO_SMOLLM2 --deselect tests/kernels/test_exl2_gemm.py
echo "total $(( $(date +%s) - T0 )) s"
