#!/usr/bin/env bash
# NOT RUN as such (session 53: five starts failed, seven calls were refused, and the device time ran out); session
# 54 ran BQ2's steps as call_BR1.sh: the flat reduce lost (k = 4 verify 1.63x). The flat reduce it measures is
# gone; restore it first: git checkout 6e00f87 -- csrc (csrc 7ed1a73c86fc), rebuild and pack the library.
# Device call BQ2 (session 53; carry .whl and .dev: this csrc's library (D: the split-K sum's loads spread over the
# threads where the quads outnumber them, gv_reduce_partials_flat; EXL2_GEMV_REDUCE=vec4 runs the old walk in the
# same library, V) and session 48's (O, .dev/libO.so.gz); BQ2_LIMIT seconds (480)):
#  1. spec_bench step costs, D and V;
#  2. the whole GPU suite that needs no SmolLM2 (tests/kernels/test_gemv_reduce_rows.py: rows of M = 5, 6 and 8
#     launches bit-identical to the rows alone), or the GEMV's tests where it does not fit;
#  3. D and V again, then O, then D by role (spec_bench --kernels), each while it fits.
export EXL2_CARRIED_LIBRARY=1
source scripts/device/common.sh
begin_card_call bq2 "${BQ2_LIMIT:-480}"
use_libraries O=.dev/libO.so.gz
cp /tmp/libD.so "$LIB"
fits 50 D1 "$L" && spec_line D1
fits 50 V1 "$L" && spec_line V1 EXL2_GEMV_REDUCE=vec4
if fits 200 "GPU suite" "$L"; then
  whole_gpu_suite "$L"
else  # the GEMV's own tests (its sums and every other part of the kernel)
  gpu_tests_verbose gemv "$(( $(left "$L") - 80 ))" -n 8 tests/kernels/test_gemv_reduce_rows.py \
    tests/kernels/test_exl2_gemm.py tests/kernels/test_gemv_norm.py tests/kernels/test_gemv_rope_kv.py \
    tests/kernels/test_gemv_repeat_identical.py tests/kernels/test_gemv_chain.py
fi
fits 50 D2 "$L" && spec_line D2
fits 50 V2 "$L" && spec_line V2 EXL2_GEMV_REDUCE=vec4
fits 50 O1 "$L" && { cp /tmp/libO.so "$LIB"; spec_line O1; cp /tmp/libD.so "$LIB"; }
fits 70 Dk "$L" && SPEC_KERNELS=1 spec_costs Dk
echo "total $(( $(date +%s) - T0 )) s"
