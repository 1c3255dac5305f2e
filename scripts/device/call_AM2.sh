#!/usr/bin/env bash
# Device call AM2 (prepared in session 23, not yet run; ~260 s). Carry .whl and .dev/libexl2_kernels.so.gz built
# from the commit that runs. Which kernel should take fp16 pages at decode. Since session 10 the tensor-core
# one-pass kernel does (variant 2: 255 registers, 2 CTAs per SM; ncu AC1: 12% occupancy, 0.27 eligible warps per
# scheduler, 53% of stall samples long-scoreboard, 49 us per layer at 32k against ~32 us of streaming); the
# CUDA-core kernel (64-72 registers, many CTAs per SM) was last measured end to end at 32k in session 7 (K2) and
# never at 1k against it. AL3 ran it with tickets only (2.554 against the tensor-core kernel's 2.572 ms with them).
#  1. scripts/attention_sweep.py at 32k and 1k: the tensor-core kernel by CTAs per SM (2 / 3 / 4) against the
#     CUDA-core one (EXL2_BACKEND_ATTN_FP16_MMA=0; 2 / 4 / 6 / 8 / 12).
#  2. bench at 1k and 32k (fp16), default against EXL2_BACKEND_ATTN_FP16_MMA=0 with EXL2_BACKEND_ATTN_CTAS_PER_SM at
#     the CUDA-core kernel's best 32k cell of the sweep.
#  0. First, two session-23 tests not yet run on a GPU: tests/engine/test_lookahead_tiny.py (the decode lookahead's
#     exactness on a tiny random model, no SmolLM2 in the carry) and, with the sampler's other tests,
#     test_greedy_tokens_rejects_bad_logits.
export EXL2_CARRIED_LIBRARY=1
source scripts/device/common.sh
begin_call am2
gpu_tests lookahead 90 tests/engine/test_lookahead_tiny.py tests/kernels/test_sampling_kernel.py
attention_sweep_32k mma fp16 2,3,4
attention_sweep_32k cc fp16 2,4,6,8,12 EXL2_BACKEND_ATTN_FP16_MMA=0
CC_CTAS=$(python3 -c "import json; r = json.load(open('$R/sweep_cc.json'))['results']['fp16']
print(min(r, key=lambda c: r[c]['us']))" 2>/dev/null || echo 4)
echo "CUDA-core kernel's best CTAs per SM at 32k: $CC_CTAS"
for v in mma cc; do
  env $([ $v = cc ] && echo EXL2_BACKEND_ATTN_FP16_MMA=0) timeout 60 python3 scripts/attention_sweep.py \
    --context 1024 --types fp16 --ctas 2,4,8 --json "$R/sweep1k_$v.json" > "$R/sweep1k_$v.txt" 2>&1
  echo "== sweep 1k $v"; grep -E "ctas/SM|Error" "$R/sweep1k_$v.txt"
done
echo "elapsed $(( $(date +%s) - T0 )) s"
bench_8b D 100 1024,32768 fp16
bench_8b CC 100 1024,32768 fp16 EXL2_BACKEND_ATTN_FP16_MMA=0 EXL2_BACKEND_ATTN_CTAS_PER_SM=$CC_CTAS
echo "total $(( $(date +%s) - T0 )) s"
