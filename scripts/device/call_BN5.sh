#!/usr/bin/env bash
# RAN in session 50 (H100): suite 2,349 passed; vectors everywhere made the decode step 1.6% slower, the k = 4 verify
# 0.5% faster; the code (5ba18b2) is reverted; BN6 (the vectors past one round only) is prepared.
# Device call BN5 (session 50; carry .whl and .dev: the library of this csrc (D) and session 48's (O, .dev/libO.so.gz,
# csrc faef46bdd949); BN5_LIMIT seconds (420)): the GEMV input copied by 16-byte vectors where a split's rows are one
# run of consecutive features (gv_gather_in_order: down_proj after fold_down_order). BN1: a k = 4 verify's down took
# 19.13 us per launch against 14.63 in a decode step, its gated gather three rounds of loads at five tokens.
#  1. the whole GPU suite without SmolLM2 with D (a new test: bit-identical to the pre-gathered input);
#  2. spec_bench step costs, O and D interleaved twice (decode step and verify ratios).
export EXL2_CARRIED_LIBRARY=1
source scripts/device/common.sh
begin_card_call bn5 "${BN5_LIMIT:-420}"
use_libraries O=.dev/libO.so.gz
suite_and_o_d_steps 60
fits 110 "kernels" "$L" && timeout 100 python3 scripts/spec_bench.py --skip smollm2,engine --iters 30 --kernels \
  --work-dir /tmp/spec_bench --out "$R/spec_Dk.json" 2> "$R/spec_Dk.log" && echo "kernels: $(grep -o 'decode [0-9.]* ms, verify ratio.*' "$R/spec_Dk.log" | cut -c1-100)"
echo "total $(( $(date +%s) - T0 )) s"
