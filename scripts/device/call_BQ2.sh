#!/usr/bin/env bash
# Device call BQ2 (session 53; carry .whl and .dev: this csrc's library (D: the split-K sum's loads spread over the
# threads where the quads outnumber them, gv_reduce_partials_flat; EXL2_GEMV_REDUCE=vec4 runs the old walk in the
# same library, V) and session 48's (O, .dev/libO.so.gz); BQ2_LIMIT seconds (480)):
#  1. the whole GPU suite that needs no SmolLM2 (tests/kernels/test_gemv_reduce_rows.py: rows of M = 5, 6 and 8
#     launches bit-identical to the rows alone);
#  2. spec_bench step costs, O, D and V interleaved twice, then D by role (spec_bench --kernels).
export EXL2_CARRIED_LIBRARY=1
source scripts/device/common.sh
begin_card_call bq2 "${BQ2_LIMIT:-480}"
use_libraries O=.dev/libO.so.gz
whole_gpu_suite "$L"
for round in 1 2; do
  fits 50 "O$round" "$L" && { cp /tmp/libO.so "$LIB"; spec_line "O$round"; }
  cp /tmp/libD.so "$LIB"
  fits 50 "D$round" "$L" && spec_line "D$round"
  fits 50 "V$round" "$L" && spec_line "V$round" EXL2_GEMV_REDUCE=vec4
done
fits 70 Dk "$L" && SPEC_KERNELS=1 spec_costs Dk
echo "total $(( $(date +%s) - T0 )) s"
