#!/usr/bin/env bash
# NOT RUN (session 54: the device time ran out after three failed starts). The post-norm code has grown since
# (the producer scatters the consumer's input); the tests below cover it.
# Device call BR5 (session 54): BR4 cut to ~220 s (two starts had failed): the post-norm GPU tests, then spec_bench P
# (EXL2_BACKEND_POST_NORM=1) and D (off) interleaved while they fit. Carry .whl and .dev. BR5_LIMIT seconds (220).
export EXL2_CARRIED_LIBRARY=1
source scripts/device/common.sh
begin_card_call br5 "${BR5_LIMIT:-220}"
fits 80 "post tests" "$L" && gpu_tests_verbose post 70 -n 8 tests/kernels/test_gemv_post.py
for round in 1 2; do
  fits 40 "P$round" "$L" && spec_line "P$round" EXL2_BACKEND_POST_NORM=1
  fits 40 "D$round" "$L" && spec_line "D$round"
done
echo "total $(( $(date +%s) - T0 )) s"
