#!/usr/bin/env bash
# Device call AE1 (prepared in session 16, not yet run; carry .whl, .dev/libexl2_kernels.so.gz and
# .dev/kv_stream_bench, built from scripts/device/kv_stream_bench.cu as its header says): is the staged
# one-pass attention (EXL2_ATTN_STAGED, csrc/layers/attn_mma_stage.cuh) worth making the default? AD1 measured it
# per kernel at 32k (scripts/attention_sweep.py, best split each): fp16 48.86 against 50.39 us per layer, q8 37.22
# against 39.98, q4 32.27 against 36.76; the attention GPU tests passed with 2 stages for the whole run (853), but
# its bit-identity test stopped at fp16 pages of D = 64 with 3 stages (48 KB of rings plus the static arrays, launched
# without the opt-in attribute; fixed since, never run).
#  1. the bit-identity test (register kernel / 2 / 3 stages) and the attention tests with 3 stages;
#  2. `bench` at 1k and 32k (fp16 / q8 / q4), register kernels against 2 stages (splits for 2 CTAs per SM with fp16
#     pages, 3 with codes: cuda_layers.ATTN_STAGED_CTAS_PER_SM), interleaved twice;
#  3. verify costs with each (the verify's 20-row attention runs three row tiles per kv head);
#  4. the attention's K/V read pattern alone (kv_stream_bench): 256-byte rows 2 KB apart per head against whole
#     slots, the same bytes and CTA count. Whether a CTA per split covering every kv head would read faster;
#  5. if time is left: the 1k decode step with splits of at least 128 keys (EXL2_BACKEND_ATTN_MIN_SPLIT; 64 by
#     default: 16 splits of one step per warp, then the reduce).
export EXL2_CARRIED_LIBRARY=1
source scripts/device/common.sh
begin_call ae1
timeout 60 .dev/kv_stream_bench 32768 2>&1 | tee "$R/kv_stream_bench.txt"
STAGED="EXL2_ATTN_STAGED=2"  # the split planning follows it (cuda_layers.ATTN_STAGED_CTAS_PER_SM)
gpu_tests_verbose identity 100 tests/kernels/test_kv_quant_kernels.py -k staged_one_pass
export EXL2_ATTN_STAGED=3
gpu_tests_verbose staged3 130 -n 12 tests/kernels/test_kv_quant_kernels.py tests/kernels/test_paged_attention.py
unset EXL2_ATTN_STAGED
echo "elapsed $(( $(date +%s) - T0 )) s"
bench_8b regs1 150 1024,32768 fp16,q8,q4
bench_8b staged1 90 1024,32768 fp16,q8,q4 $STAGED
bench_8b regs2 90 1024,32768 fp16,q8,q4
bench_8b staged2 90 1024,32768 fp16,q8,q4 $STAGED
echo "elapsed $(( $(date +%s) - T0 )) s"
spec_costs regs
spec_costs staged $STAGED
if [ "$(left 590)" -gt 90 ]; then  # 5. the 1k decode with splits of at least 128 keys (two steps per warp)
  decode_step_1k split64 nochain
  decode_step_1k split128 nochain EXL2_BACKEND_ATTN_MIN_SPLIT=128
  attention_paths split64 split128
fi
echo "total $(( $(date +%s) - T0 )) s"
