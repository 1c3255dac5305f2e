#!/usr/bin/env bash
# SUPERSEDED by call_BP2.sh (session 52), which ran it: no gain (the code is reverted again; see call_BP2.sh).
# Device call BN6 (session 50; carry .whl and .dev: this csrc's library (D) and session 48's (O, .dev/libO.so.gz);
# BN6_LIMIT seconds (220)): BN5's vector copy of in-order GEMV inputs, now only where the two-byte items would take
# more than one round of loads (BN5: the decode step 2.337 / 2.314 ms against O's 2.280 / 2.301, the verify 0.5%
# faster). 1. the in-order GEMV tests; 2. spec_bench step costs, O and D interleaved twice.
export EXL2_CARRIED_LIBRARY=1
source scripts/device/common.sh
begin_card_call bn6 "${BN6_LIMIT:-220}"
use_libraries O=.dev/libO.so.gz
gpu_tests fold 60 tests/kernels/test_fold_down_order_cuda.py
each_library "$L" 45 "O D O D" spec_line
echo "total $(( $(date +%s) - T0 )) s"
