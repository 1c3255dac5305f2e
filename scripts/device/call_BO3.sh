#!/usr/bin/env bash
# PREPARED in session 51, not run (the session's device time went to starts that found no machine).
# Device call BO3 (session 51; carry .whl and .dev: this csrc's library (D) and session 48's (O, .dev/libO.so.gz);
# BO3_LIMIT seconds (540)): the stored-order norm as its own kernel (kFNormLaunch) for norm launches past one pass
# of one row per thread (a verify's q/k/v, gate/up and head at M >= 3); the decode step's kernels are unchanged
# (their SASS equal to session 48's but for one parameter offset). BO1 ran the first form in every kernel.
#  1. the GEMV GPU tests (bit-identity of both norm forms with add_rms_norm + GEMV; the model forward at 5 rows);
#  2. spec_bench step costs interleaved twice: O = session 48's library with its routing (fused norm up to two rows:
#     EXL2_BACKEND_NORM_MAX_ROWS=2), D = the stored-order norm up to four rows (EXL2_BACKEND_NORM_STORED=1), P = up
#     to eight (and EXL2_BACKEND_FUSED_NORM_PASSES=2: the k = 4 verify fused); the default routing (stored-order
#     norm off) is O's, on a kernel whose SASS is O's;
#  3. P's verify by role (spec_bench --kernels); 4. the whole GPU suite that needs no SmolLM2, if time is left.
export EXL2_CARRIED_LIBRARY=1
source scripts/device/common.sh
begin_card_call bo3 "${BO3_LIMIT:-540}"
use_libraries O=.dev/libO.so.gz
gpu_tests gemv 120 -n 8 $GEMV_GPU_TESTS -k "not llama3_8b"
NORM_D_ENV="EXL2_BACKEND_NORM_STORED=1" NORM_P_ENV="EXL2_BACKEND_NORM_STORED=1 EXL2_BACKEND_FUSED_NORM_PASSES=2"
for v in O1 D1 P1 O2 D2 P2; do fits 50 "$v" "$L" && norm_variant_costs "$v"; done
cp /tmp/libD.so "$LIB"
if fits 80 Pk "$L"; then
  EXL2_BACKEND_NORM_STORED=1 EXL2_BACKEND_FUSED_NORM_PASSES=2 timeout 80 python3 scripts/spec_bench.py --skip smollm2 --iters 30 --kernels \
    --work-dir /tmp/spec_bench --out "$R/spec_Pk.json" 2> "$R/spec_Pk.log"
  echo "== spec Pk: $(grep -o 'decode [0-9.]* ms, verify ratio.*' "$R/spec_Pk.log" | head -1 | cut -c1-120)"
fi
whole_gpu_suite "$L"
echo "total $(( $(date +%s) - T0 )) s"
