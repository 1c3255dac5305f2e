#!/usr/bin/env bash
# NOT RUN (session 55: four starts found no machine, then too little device time was left). Main went back to the
# item gather (d2c9368's code); this call measures 3388301's csrc / package / tests (the 8-byte gated gather, W4):
# check them out first (git checkout 3388301 -- csrc exl2_backend tests), build, pack_library.sh.
# Device call BS3 (session 55): BS2 cut to ~220 s after two starts found no machine: the GEMV GPU tests on W4 (this
# csrc: down's gated input by 8-byte vectors), then spec_bench W4 and O (d2c9368's tree, session 48's library)
# interleaved while they fit. Carry .whl and .dev. BS3_LIMIT seconds (220).
export EXL2_CARRIED_LIBRARY=1
source scripts/device/common.sh
begin_card_call bs3 "${BS3_LIMIT:-220}"
mkdir -p /tmp/treeO && tar xzf .dev/treeO.tar.gz -C /tmp/treeO && mkdir -p /tmp/treeO/exl2_backend/_lib &&
  gunzip -c .dev/libO.so.gz > /tmp/treeO/exl2_backend/_lib/libexl2_kernels.so
fits 70 "GEMV tests" "$L" && gpu_tests_verbose gemv 60 -n 8 $GEMV_GPU_TESTS tests/kernels/test_gemv_reduce_rows.py
for round in 1 2 3; do
  fits 36 "W$round" "$L" && spec_line "W$round"
  fits 36 "O$round" "$L" && (cd /tmp/treeO && PYTHONPATH=/tmp/treeO:/tmp/site spec_line "O$round")
done
echo "total $(( $(date +%s) - T0 )) s"
