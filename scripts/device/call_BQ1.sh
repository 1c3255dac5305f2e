#!/usr/bin/env bash
# RAN in session 53 (asked for nvidia-h200, ran on an H100, 407 s): suite 2,382 passed, 2 failed (a call count in
# test_gemv_rope_kv.py that the feed changed), 17 skipped; decode O 2.303 / 2.296 ms, D (feed) 2.353 / 2.374, F (feed
# off, the canonical order alone) 2.329 / 2.325; k = 4 verify O 1.240x / 1.241x, D 1.516x / 1.504x, F 1.246x /
# 1.249x. The feed lost everywhere and is removed; running this needs 30780fd's csrc, Python and tests.
# Device call BQ1 (session 53; carry .whl and .dev: this csrc's library (D: the norm fed by the GEMV before it,
# ops/cuda_feed.py, and every norm kernel summing in the canonical tile order) and session 48's (O,
# .dev/libO.so.gz, which has no feed: its runs take the old path); BQ1_LIMIT seconds (480)):
#  1. the whole GPU suite that needs no SmolLM2 (tests/kernels/test_gemv_feed.py: feed and fed norm bit-identical to
#     the ops one by one at every width, the model forward with the feed on and off);
#  2. spec_bench step costs, O and D interleaved twice, then D with the feed off (EXL2_BACKEND_NORM_FEED=0: the
#     canonical order's cost alone) twice, then D by role (spec_bench --kernels);
#  3. the 8B decode at 1k and 32k (bench, fp16) if time is left.
export EXL2_CARRIED_LIBRARY=1
source scripts/device/common.sh
begin_card_call bq1 "${BQ1_LIMIT:-480}"
use_libraries O=.dev/libO.so.gz
suite_and_o_d_steps 50
fits 50 F1 "$L" && spec_line F1 EXL2_BACKEND_NORM_FEED=0
fits 50 F2 "$L" && spec_line F2 EXL2_BACKEND_NORM_FEED=0
fits 70 Dk "$L" && SPEC_KERNELS=1 spec_costs Dk
fits 100 bench "$L" && bench_8b final 90 1024,32768 fp16
echo "total $(( $(date +%s) - T0 )) s"
