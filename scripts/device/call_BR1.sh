#!/usr/bin/env bash
# Device call BR1 (session 54): session 53's unrun BQ2 (the flat split-K reduce, csrc of 6e00f87, 7ed1a73c86fc)
# plus the ceiling of a norm applied at the GEMV's output. Carry .whl and .dev (this csrc's library, D; session
# 48's, O, .dev/libO.so.gz). BR1_LIMIT seconds (480):
#  1. spec_bench D, V (EXL2_GEMV_REDUCE=vec4: the old walk in the same library), and N0: every q/k/v, gate/up and
#     head GEMV reads a pre-gathered input (EXL2_BACKEND_NORM_SMEM_BYTES=0) and no norm runs at all
#     (EXL2_BACKEND_MEASURE_SKIP_NORM_PREGATHER=1; results wrong, engine steps skipped): what decode and verify
#     would cost if the norm's scale were applied at the GEMV's output and its sums came free;
#  2. the whole GPU suite that needs no SmolLM2 (tests/kernels/test_gemv_reduce_rows.py among it);
#  3. D, V, N0 again, O, then D by role, each while it fits.
export EXL2_CARRIED_LIBRARY=1
source scripts/device/common.sh
begin_card_call br1 "${BR1_LIMIT:-480}"
use_libraries O=.dev/libO.so.gz
N0=(EXL2_BACKEND_NORM_SMEM_BYTES=0 EXL2_BACKEND_MEASURE_SKIP_NORM_PREGATHER=1)
fits 50 D1 "$L" && spec_line D1
fits 50 V1 "$L" && spec_line V1 EXL2_GEMV_REDUCE=vec4
fits 50 N01 "$L" && SPEC_SKIP=engine spec_line N01 "${N0[@]}"
whole_gpu_suite "$L"
fits 50 D2 "$L" && spec_line D2
fits 50 V2 "$L" && spec_line V2 EXL2_GEMV_REDUCE=vec4
fits 50 N02 "$L" && SPEC_SKIP=engine spec_line N02 "${N0[@]}"
fits 50 O1 "$L" && { cp /tmp/libO.so "$LIB"; spec_line O1; cp /tmp/libD.so "$LIB"; }
fits 70 Dk "$L" && SPEC_KERNELS=1 spec_costs Dk
echo "total $(( $(date +%s) - T0 )) s"
