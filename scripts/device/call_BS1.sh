#!/usr/bin/env bash
# Ran in session 55 on 9869444's tree (H100, 286 s); main went back to the item gather (d2c9368's code) afterwards.
# Device call BS1 (session 55): the gated input of down_proj gathered by 16-byte vectors (gv_gather_gated_vec8; the
# TMA kernel no longer compiles the 2-byte gated gathers; a launch whose xmap is not in aligned runs of 8 is
# pre-gathered). The blob grew a field (C ABI 14), so the baseline O runs its own tree: d2c9368's package and
# scripts with session 48's library (.dev/treeO.tar.gz, .dev/libO.so.gz). Carry .whl and .dev. BS1_LIMIT seconds:
#  1. the GEMV GPU tests (the vector gather's tests in test_fold_down_order_cuda.py among them), rows and repeats;
#  2. spec_bench V (this tree) and O interleaved twice; 3. V by role (the five-row down of a k = 4 verify).
export EXL2_CARRIED_LIBRARY=1
source scripts/device/common.sh
begin_card_call bs1 "${BS1_LIMIT:-450}"
carried_tree /tmp/treeO .dev/treeO.tar.gz .dev/libO.so.gz
spec_O() { in_tree /tmp/treeO spec_line "$@"; }
fits 110 "GEMV tests" "$L" && gpu_tests_verbose gemv 100 -n 8 $GEMV_GPU_TESTS tests/kernels/test_gemv_reduce_rows.py \
  tests/kernels/test_gemv_repeat_identical.py
for round in 1 2; do
  fits 45 "V$round" "$L" && spec_line "V$round"
  fits 45 "O$round" "$L" && spec_O "O$round"
done
fits 50 Vk "$L" && SPEC_KERNELS=1 spec_costs Vk
fits 50 Ok "$L" && SPEC_KERNELS=1 in_tree /tmp/treeO spec_costs Ok
echo "total $(( $(date +%s) - T0 )) s"
