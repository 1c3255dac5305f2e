#!/usr/bin/env bash
# Device call M2 (session 8; the warm machine of M1, carry nothing but the tree: the wheels and the library are
# still there): with the GEMV chain on by default, the GPU tests without SmolLM2 that M1 did not run (attention,
# layers, sampling, engine prefill memory, serving batch invariance, multi-GPU on one device, converter).
export EXL2_SKIP_BUILD=1
source scripts/device/common.sh
results_dir
trap '[ -d "$R" ] && pack_results m2' EXIT
t=$(date +%s)
gpu_tests rest 170 $CUDA_TESTS_NO_SMOLLM2 --timeout 120 --ignore=tests/kernels/test_gemv_chain.py \
  --ignore=tests/kernels/test_gemv_norm.py --ignore=tests/kernels/test_exl2_gemm.py
echo "tests $(( $(date +%s) - t )) s"
