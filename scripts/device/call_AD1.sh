#!/usr/bin/env bash
# Device call AD1 (session 16; carry .whl and .dev/libexl2_kernels.so.gz; ~200 s): the one-pass attention with each
# warp's steps staged in shared memory by cp.async (EXL2_ATTN_STAGED=2 / 3 stages; csrc/layers/attn_mma_stage.cuh;
# never run before this call). AC1's ncu had the register kernel (fp16 pages, 255 registers, 8 warps per SM) waiting
# on its K loads for 53% of its stall samples.
#  1. scripts/attention_sweep.py at 32k, us per layer by CTAs per SM: the register kernels (default variants) and the
#     staged kernel (168 registers, 3 CTAs per SM with 2 stages) through variant 2 for every format;
#  2. its bit-identity to the register kernel (subprocesses), then the attention GPU tests with EXL2_ATTN_STAGED=2
#     for the whole run (every one-pass launch staged) as far as the time allows.
export EXL2_CARRIED_LIBRARY=1
source scripts/device/common.sh
begin_call ad1
attention_sweep_32k regs fp16,q8,q4 2,3,4
attention_sweep_32k staged2 fp16,q8,q4 2,3,4 EXL2_ATTN_STAGED=2 EXL2_BACKEND_ATTN_MMA_ONLINE=2
attention_sweep_32k staged3 fp16,q8,q4 2,3 EXL2_ATTN_STAGED=3 EXL2_BACKEND_ATTN_MMA_ONLINE=2
echo "elapsed $(( $(date +%s) - T0 )) s"
gpu_tests_verbose identity 90 tests/kernels/test_kv_quant_kernels.py -k staged_one_pass
export EXL2_ATTN_STAGED=2
gpu_tests_verbose staged "$(left 215)" -n 12 tests/kernels/test_kv_quant_kernels.py tests/kernels/test_paged_attention.py
unset EXL2_ATTN_STAGED
echo "total $(( $(date +%s) - T0 )) s"
