#!/usr/bin/env bash
# RAN in session 56 (BS2_LIMIT=470, H100: W4 kept the decode step and took 29 us off the k = 4 verify; landed).
# Device call BS2: down's gated input by 8-byte vectors of 4 features (W4: 3388301's csrc, package and tests) against
# 16-byte vectors (V: 9869444's library, BS1: down lost 0.5 us per launch at one row, gained 0.7 at five) and main
# (O: this tree and its carried library, the item gather). W4 and V need C ABI 14, so they run from their own tree:
# .dev/treeW4.tar.gz (git archive 3388301 exl2_backend scripts tests setup.py pyproject.toml) with .dev/libW4.so.gz
# (built from 3388301's csrc, ef2d49a0e154) or .dev/libV.so.gz. Carry .whl and .dev. BS2_LIMIT seconds (330):
# the GEMV GPU tests in W4's tree, then spec_bench W4 O V interleaved twice, then W4 by role (a smaller limit,
# e.g. 220 after failed starts, runs what fits); with 575 also W4's whole GPU suite.
export EXL2_CARRIED_LIBRARY=1
source scripts/device/common.sh
begin_card_call bs2 "${BS2_LIMIT:-330}"
T=/tmp/treeW4
carried_tree $T .dev/treeW4.tar.gz .dev/libW4.so.gz && cp $T/exl2_backend/_lib/libexl2_kernels.so /tmp/libW4.so &&
  gunzip -c .dev/libV.so.gz > /tmp/libV.so
in_w() { in_tree $T "$@"; }  # W4's package, scripts and tests
fits 80 "GEMV tests (W4)" "$L" && in_w gpu_tests_verbose gemv 70 -n 8 $GEMV_GPU_TESTS \
  tests/kernels/test_gemv_reduce_rows.py tests/kernels/test_gemv_repeat_identical.py
for round in 1 2; do
  fits 40 "W$round" "$L" && in_w spec_line "W$round"
  fits 40 "O$round" "$L" && spec_line "O$round"
  fits 40 "V$round" "$L" && { cp /tmp/libV.so $T/exl2_backend/_lib/libexl2_kernels.so; in_w spec_line "V$round"
    cp /tmp/libW4.so $T/exl2_backend/_lib/libexl2_kernels.so; }
done
fits 45 Wk "$L" && SPEC_KERNELS=1 in_w spec_costs Wk
in_w whole_gpu_suite "$L"  # W4's whole GPU suite (no SmolLM2), so a win can land without another call
echo "total $(( $(date +%s) - T0 )) s"
