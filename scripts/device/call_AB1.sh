#!/usr/bin/env bash
# Device call AB1 (session 16; carry .whl and .dev/libexl2_kernels.so.gz): the one-pass attention kernel's loads
# as a ring of register slots (EXL2_ATTN_ROTATE: 0 the batch of two steps it replaced, 2 a ring of two slots, the
# new default, 3 a ring of three, a measurement build that spills in fp16 and q8). At 32k the fp16 attention ran
# ~50 us per layer, 2.7 TB/s: each warp requested two steps, waited, computed both, and only then requested more.
#  1. scripts/attention_sweep.py at 32k, us per layer by CTAs per SM, for each load pattern (q4 runs the one-slot
#     variant 1 by default, where nothing rotates: its rows with EXL2_BACKEND_ATTN_MMA_ONLINE=2 test the rings);
#  2. `bench` at 32k, fp16 and q8 caches, ring against batch, twice interleaved;
#  3. the attention GPU tests (every format pair through every kernel, the rings' bit-identity).
export EXL2_CARRIED_LIBRARY=1
source scripts/device/common.sh
begin_call ab1
sweep() {
  local name=$1 types=$2 ctas=$3; shift 3
  env "$@" timeout 90 python3 scripts/attention_sweep.py --context 32768 --types "$types" --ctas "$ctas" \
    --json "$R/sweep_$name.json" > "$R/sweep_$name.txt" 2>&1
  echo "== sweep $name ($*)"; grep "ctas/SM" "$R/sweep_$name.txt"
}
sweep batch fp16,q8,q4 2,3,4 EXL2_ATTN_ROTATE=0
sweep ring2 fp16,q8,q4 2,3,4 EXL2_ATTN_ROTATE=2
sweep batch_u2 q4 2,3 EXL2_ATTN_ROTATE=0 EXL2_BACKEND_ATTN_MMA_ONLINE=2
sweep ring2_u2 q4 2,3 EXL2_ATTN_ROTATE=2 EXL2_BACKEND_ATTN_MMA_ONLINE=2
sweep ring3_u2 q4,q8,fp16 2,3 EXL2_ATTN_ROTATE=3 EXL2_BACKEND_ATTN_MMA_ONLINE=2
echo "elapsed $(( $(date +%s) - T0 )) s"
bench_8b batch1 150 32768 fp16,q8 EXL2_ATTN_ROTATE=0
bench_8b ring1 90 32768 fp16,q8 EXL2_ATTN_ROTATE=2
bench_8b batch2 90 32768 fp16,q8 EXL2_ATTN_ROTATE=0
bench_8b ring2 90 32768 fp16,q8 EXL2_ATTN_ROTATE=2
echo "elapsed $(( $(date +%s) - T0 )) s"
gpu_tests_verbose attn "$(left 560)" -n 12 tests/kernels/test_kv_quant_kernels.py tests/kernels/test_paged_attention.py
echo "total $(( $(date +%s) - T0 )) s"
