#!/usr/bin/env bash
# Ran in session 55 (on e187d9e's tree, H100): the post norm passed its tests and lost (decode 2.58 / 2.60 ms against
# 2.27 / 2.28); its code is gone (in git history at e187d9e), so this script no longer runs on the current tree.
# Device call BR4 (session 54): the RMSNorm applied at the GEMV's output (ops/cuda_post.py, EXL2_BACKEND_POST_NORM=1;
# off by default). Carry .whl and .dev (this csrc's library, D; session 48's, O, .dev/libO.so.gz). BR4_LIMIT
# seconds (420):
#  1. tests/kernels/test_gemv_post.py (feed = GEMV + row_feed bit for bit, rows alone, rope form, the model forward);
#  2. spec_bench P (D with the routing on), D (off), O, P, D, each while it fits;
#  3. the GEMV's other GPU tests (the new code compiled into every launch), then P by role.
export EXL2_CARRIED_LIBRARY=1
source scripts/device/common.sh
begin_card_call br4 "${BR4_LIMIT:-420}"
use_libraries O=.dev/libO.so.gz
fits 100 "post tests" "$L" && gpu_tests_verbose post 90 -n 8 tests/kernels/test_gemv_post.py
fits 45 P1 "$L" && spec_line P1 EXL2_BACKEND_POST_NORM=1
fits 45 D1 "$L" && spec_line D1
fits 45 O1 "$L" && { cp /tmp/libO.so "$LIB"; spec_line O1; cp /tmp/libD.so "$LIB"; }
fits 45 P2 "$L" && spec_line P2 EXL2_BACKEND_POST_NORM=1
fits 45 D2 "$L" && spec_line D2
fits 80 "GEMV tests" "$L" && gpu_tests_verbose gemv "$(( $(left "$L") - 60 ))" -n 8 tests/kernels/test_exl2_gemm.py \
  tests/kernels/test_gemv_norm.py tests/kernels/test_gemv_rope_kv.py tests/kernels/test_gemv_reduce_rows.py
fits 50 Pk "$L" && SPEC_KERNELS=1 spec_costs Pk EXL2_BACKEND_POST_NORM=1
echo "total $(( $(date +%s) - T0 )) s"
