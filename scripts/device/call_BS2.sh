#!/usr/bin/env bash
# NOT RUN (session 55: four starts found no machine, then too little device time was left). Main went back to the
# item gather (d2c9368's code); this call measures 3388301's csrc / package / tests (the 8-byte gated gather, W4):
# check them out first (git checkout 3388301 -- csrc exl2_backend tests), build, pack_library.sh.
# Device call BS2 (session 55): BS1's vector gather of down's gated input with 4 features per vector (W4, this csrc)
# against 8 (V, BS1's library, .dev/libV.so.gz: down lost 0.5 us per launch at one row, gained 0.7 at five) and O
# (d2c9368's tree and session 48's library, .dev/treeO.tar.gz / .dev/libO.so.gz; C ABI 13). Carry .whl and .dev.
# BS2_LIMIT seconds (330): the GEMV GPU tests on W4, then spec_bench W4 O V interleaved twice, then W4 by role.
export EXL2_CARRIED_LIBRARY=1
source scripts/device/common.sh
begin_card_call bs2 "${BS2_LIMIT:-330}"
use_libraries V=.dev/libV.so.gz
mkdir -p /tmp/treeO && tar xzf .dev/treeO.tar.gz -C /tmp/treeO && mkdir -p /tmp/treeO/exl2_backend/_lib &&
  gunzip -c .dev/libO.so.gz > /tmp/treeO/exl2_backend/_lib/libexl2_kernels.so
fits 80 "GEMV tests" "$L" && gpu_tests_verbose gemv 70 -n 8 $GEMV_GPU_TESTS tests/kernels/test_gemv_reduce_rows.py \
  tests/kernels/test_gemv_repeat_identical.py
for round in 1 2; do
  fits 40 "W$round" "$L" && spec_line "W$round"
  fits 40 "O$round" "$L" && (cd /tmp/treeO && PYTHONPATH=/tmp/treeO:/tmp/site spec_line "O$round")
  fits 40 "V$round" "$L" && { cp /tmp/libV.so "$LIB"; spec_line "V$round"; cp /tmp/libD.so "$LIB"; }
done
fits 45 Wk "$L" && SPEC_KERNELS=1 spec_costs Wk
echo "total $(( $(date +%s) - T0 )) s"
