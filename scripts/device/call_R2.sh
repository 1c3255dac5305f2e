#!/usr/bin/env bash
# Device call R2 (session 10; carry .whl and .dev/libexl2_kernels.so.gz). After R1 (fold_down_order: 8B decode
# step 2.732 -> 2.637 ms; the pre-gathering norm: k = 4 verify 3.414 -> 3.287 ms), the GEMV's gated input (down_proj)
# gathered by 16-byte vectors where its rows are in input order (gv_gather_vec):
#  1. the 8B decode step at 1k and verify costs, vector gather (default) against the item gather of R1
#     (EXL2_GEMV_GATHER=items); kernel tables of the decode and verify graphs (spec_bench --kernels);
#  2. `bench` with the final defaults, 1k and 32k, every cache type;
#  3. GPU tests of everything this session touched (R1's ran out of time at ~840 of ~970, none failing);
#  4. ExLlamaV2 0.3.2 at 1k on the same random 8B directory, with ours, if time is left.
export EXL2_CARRIED_LIBRARY=1
source scripts/device/common.sh
results_dir
trap '[ -d "$R" ] && pack_results r2' EXIT
start_exllamav2_jit
T0=$(date +%s)
left() { echo $(( ${1} - ($(date +%s) - T0) )); }
for v in "vec" "items EXL2_GEMV_GATHER=items"; do
  set -- $v; name=$1; shift
  decode_step_1k "$name" nochain "$@"
  grep -A3 "critical path" "$R/prof_$name.txt" | grep gemv_tma | head -1
done
spec_costs items EXL2_GEMV_GATHER=items
timeout 90 python3 scripts/spec_bench.py --skip smollm2 --iters 30 --kernels --work-dir /tmp/spec_bench \
  --out "$R/spec_kernels.json" 2> "$R/spec_kernels.log"
echo "== spec default: $(grep 'step costs' "$R/spec_kernels.log" | tail -1)"
echo "steps $(( $(date +%s) - T0 )) s"
bench_8b final 150 1024,32768 fp16,fp8,q8,q6,q4
echo "bench $(( $(date +%s) - T0 )) s"
gpu_tests tests 170 -n 4 tests/kernels/test_fold_down_order_cuda.py tests/kernels/test_gemv_norm.py \
  tests/kernels/test_exl2_gemm.py tests/kernels/test_gemv_chain.py tests/serve/test_batch_invariance.py \
  "tests/kernels/test_paged_attention.py" -k "not (cuda_core or mma-) or online2"
echo "tests $(( $(date +%s) - T0 )) s"
if [ "$(left 560)" -gt 120 ]; then
  exllamav2_vs_ours "$(left 560)"
fi
echo "total $(( $(date +%s) - T0 )) s"
