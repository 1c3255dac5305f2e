#!/usr/bin/env bash
# NOT RUN yet (session 56: too little device time was left after BS2). Device call BS4: the whole GPU suite that
# needs no SmolLM2 on main with down's gated input by 8-byte vectors (csrc ef2d49a0e154, landed after BS2, where the
# GEMV's own GPU tests passed: 425), then spec_bench once. Carry .whl and .dev (.dev/libexl2_kernels.so.gz packed
# from that csrc). BS4_LIMIT seconds (300; 240 runs the suite only).
export EXL2_CARRIED_LIBRARY=1
source scripts/device/common.sh
begin_card_call bs4 "${BS4_LIMIT:-300}"
whole_gpu_suite "$L"
fits 45 "spec W" "$L" && spec_line W
echo "total $(( $(date +%s) - T0 )) s"
