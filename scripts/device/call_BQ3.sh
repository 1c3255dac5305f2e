#!/usr/bin/env bash
# NOT RUN as such (session 53: five starts failed, seven calls were refused, and the device time ran out); session
# 54 ran BQ2's steps as call_BR1.sh: the flat reduce lost (k = 4 verify 1.63x). The flat reduce it measures is
# gone; restore it first: git checkout 6e00f87 -- csrc (csrc 7ed1a73c86fc), rebuild and pack the library.
# Device call BQ3 (session 53): BQ2 cut to what ~200 s of device time holds (four starts had failed and five calls
# had been refused). Carry .whl and .dev (this csrc's library: the split-K sum's loads spread over the threads where
# the quads outnumber them, gv_reduce_partials_flat; EXL2_GEMV_REDUCE=vec4 runs the old walk in the same library,
# V); BQ3_LIMIT seconds (200):
#  1. spec_bench step costs, D then V;
#  2. tests/kernels/test_gemv_reduce_rows.py (rows of M = 5, 6 and 8 launches bit-identical to the rows alone);
#  3. D and V again, then the GEMV's other GPU tests, while time is left.
export EXL2_CARRIED_LIBRARY=1
source scripts/device/common.sh
begin_card_call bq3 "${BQ3_LIMIT:-200}"
fits 40 D1 "$L" && spec_line D1
fits 40 V1 "$L" && spec_line V1 EXL2_GEMV_REDUCE=vec4
fits 30 "rows test" "$L" && gpu_tests_verbose rows "$(( $(left "$L") - 10 ))" -n 8 \
  tests/kernels/test_gemv_reduce_rows.py
for round in 2 3; do
  fits 40 "D$round" "$L" && spec_line "D$round"
  fits 40 "V$round" "$L" && spec_line "V$round" EXL2_GEMV_REDUCE=vec4
done
fits 30 "GEMV tests" "$L" && gpu_tests_verbose gemv "$(( $(left "$L") - 10 ))" -n 8 tests/kernels/test_exl2_gemm.py \
  tests/kernels/test_gemv_norm.py tests/kernels/test_gemv_rope_kv.py tests/kernels/test_gemv_repeat_identical.py
echo "total $(( $(date +%s) - T0 )) s"
