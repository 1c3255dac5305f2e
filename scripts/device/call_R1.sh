#!/usr/bin/env bash
# Device call R1 (session 10; carry .whl and .dev/libexl2_kernels.so.gz, which adds exl2_gemv_norm_pregather.cu).
#  1. GPU tests of the three changes: down_proj's row order folded into gate/up (model/tp_shard.fold_down_order;
#     down's input then gathered contiguously, never pre-gathered), add_rms_norm writing the GEMV's stored row
#     order for rows past one fused-norm pass (exl2_add_norm_pregather), and the per-format attention variants;
#  2. the 8B decode step at 1k, folded against the file's order (EXL2_BACKEND_FOLD_DOWN_ORDER=0), and verify costs
#     with each of the two GEMV-input changes off (EXL2_BACKEND_NORM_PREGATHER=0);
#  3. `bench` at 1k and 32k, fp16 / q8 / q4: the new defaults against the old ones (all three off);
#  4. fp8 and q6 at 32k with each attention variant (their defaults are still the two-pass kernel).
export EXL2_CARRIED_LIBRARY=1
source scripts/device/common.sh
results_dir
trap '[ -d "$R" ] && pack_results r1' EXIT
T0=$(date +%s)
left() { echo $(( ${1} - ($(date +%s) - T0) )); }
gpu_tests tests 200 -n 4 tests/kernels/test_fold_down_order_cuda.py tests/kernels/test_gemv_norm.py \
  tests/kernels/test_paged_attention.py tests/kernels/test_kv_quant_kernels.py tests/kernels/test_gemv_chain.py \
  tests/serve/test_batch_invariance.py tests/unit/test_attention_planning.py tests/unit/test_fold_down_order.py
echo "tests $(( $(date +%s) - T0 )) s"
for v in "fold" "nofold EXL2_BACKEND_FOLD_DOWN_ORDER=0"; do
  set -- $v; name=$1; shift
  decode_step_1k "$name" nochain "$@"
  grep -A3 "critical path" "$R/prof_$name.txt" | grep gemv_tma | head -1
done
for v in "new" "nofold EXL2_BACKEND_FOLD_DOWN_ORDER=0" "nonormpg EXL2_BACKEND_NORM_PREGATHER=0" \
         "neither EXL2_BACKEND_FOLD_DOWN_ORDER=0 EXL2_BACKEND_NORM_PREGATHER=0"; do
  spec_costs $v
done
echo "fold $(( $(date +%s) - T0 )) s"
bench_8b new 120 1024,32768 fp16,q8,q4
bench_8b old 120 1024,32768 fp16,q8,q4 EXL2_BACKEND_ATTN_MMA_ONLINE=0 EXL2_BACKEND_FOLD_DOWN_ORDER=0 \
  EXL2_BACKEND_NORM_PREGATHER=0
echo "bench $(( $(date +%s) - T0 )) s"
for online in 0 1 2; do
  [ "$(left 560)" -gt 50 ] || break
  bench_8b "fp8q6_online$online" 120 32768 fp8,q6 EXL2_BACKEND_ATTN_MMA_ONLINE=$online
done
echo "total $(( $(date +%s) - T0 )) s"
