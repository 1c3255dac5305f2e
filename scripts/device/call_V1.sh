#!/usr/bin/env bash
# Device call V1 (session 13; carry .whl and .dev): 3-bit weights packed as whole fields (pair_qz<3>: 66 INT ops
# per warp chunk instead of 132, 184 instructions instead of 248) and scales staged by the smallest group
# (F_GROUP_ROWS, C ABI 5: the 6-bit head stages 14 KB instead of 56 KB per block). A = the Python and library of
# fa93e31 (.dev/abold, carried), B = this tree.
#  1. the 8B decode step at 1k, A / B interleaved twice; B prints each role's GEMV time by bit widths;
#  2. the GEMV, dequant and layout GPU tests with B;
#  3. B with a ring floor of 3 and 4 slots (affordable for the head now that its scales shrank);
#  4. bench_gemm --m1 for A and B (M = 1 per shape and width).
export EXL2_CARRIED_LIBRARY=1
source scripts/device/common.sh
begin_call v1
gunzip -c .dev/abold/old.so.gz > .dev/abold/exl2_backend/_lib/libexl2_kernels.so
# The old tree's decode step: its own scripts and package first on the path.
decode_old() {
  (cd .dev/abold && PYTHONPATH="$PWD:/tmp/site" timeout 80 python3 scripts/profile_decode.py --shapes llama3-8b \
    --variants nochain --workdir /tmp/prof --context 1024 --cache-types fp16 --out "$R/p_$1" > "$R/prof_$1.txt" 2>&1)
  echo "== $1"; grep -E "^######## " "$R/prof_$1.txt" | cut -c1-140
}
roles() { grep -A7 "GEMVs by role" "$R/prof_$1.txt" | tail -5; }
kinds() { grep -A14 "by the launch's bit widths" "$R/prof_$1.txt" | grep -E "^(q/k/v|o|gate/up|down) "; }
decode_old A1; roles A1
decode_step_1k B1 nochain; roles B1; kinds B1
decode_old A2; roles A2
decode_step_1k B2 nochain; roles B2
echo "steps $(( $(date +%s) - T0 )) s"
gpu_tests kern "$(left 330)" -n 8 tests/kernels/test_exl2_gemm.py tests/kernels/test_exl2_dequant.py \
  tests/kernels/test_gemv_norm.py tests/kernels/test_gemv_rope_kv.py tests/kernels/test_fold_down_order_cuda.py \
  tests/kernels/test_gemv_chain.py -k "not llama3_8b" tests/unit/test_gemv_split_plan.py tests/unit/test_kernel_layout.py
echo "tests $(( $(date +%s) - T0 )) s"
decode_step_1k st3 nochain EXL2_GEMV_MIN_STAGES=3; roles st3
decode_step_1k st4 nochain EXL2_GEMV_MIN_STAGES=4; roles st4
echo "floors $(( $(date +%s) - T0 )) s"
timeout "$(left 560)" python3 scripts/bench_gemm.py --m1 > "$R/gemm_B.txt" 2>&1; grep "^M1" "$R/gemm_B.txt"
(cd .dev/abold && PYTHONPATH="$PWD:/tmp/site" timeout "$(left 590)" python3 ../../scripts/bench_gemm.py --m1 \
  > "$R/gemm_A.txt" 2>&1); grep "^M1" "$R/gemm_A.txt"
echo "total $(( $(date +%s) - T0 )) s"
