#!/usr/bin/env bash
# NOT RUN yet (session 56: too little device time was left after BS2; session 57: eleven attempts found no machine,
# then the loans were paused). Device call BS4 on main, which carries down's gated input by 8-byte vectors since
# session 56 (csrc ef2d49a0e154; BS2 ran the GEMV's own GPU tests: 425 passed):
#  1. the whole GPU suite that needs no SmolLM2 (~200 s);
#  2. spec_bench W (main) against O (the item gather: d2c9368's package with session 48's library, carried as
#     .dev/treeO.tar.gz and .dev/libO.so.gz) interleaved twice: BS2's one call measured the decode step equal and
#     k = 8 ~11 us slower, which more runs confirm or not.
#  On an H200 (the targets' card; most calls since session 29 got an H100) step 2 gives way to the targets' figures
#  instead: `bench` at 1k and 32k (fp16), spec_bench twice, ExLlamaV2 beside ours (its JIT builds during the suite).
# Carry .whl and .dev (.dev/libexl2_kernels.so.gz packed from main's csrc). BS4_LIMIT seconds (420, 560 for an H200's
# whole list; 240 runs the suite only).
export EXL2_CARRIED_LIBRARY=1
source scripts/device/common.sh
begin_card_call bs4 "${BS4_LIMIT:-420}"
# O's tree and library, where a fresh checkout lacks them: `git archive d2c9368 | gzip > .dev/treeO.tar.gz`, and
# `bash scripts/device/prepare_carry.sh --baseline d2c9368 && mv .dev/libE.so.gz .dev/libO.so.gz`.
have_O=0
[ -f .dev/treeO.tar.gz ] && [ -f .dev/libO.so.gz ] &&
  carried_tree /tmp/treeO .dev/treeO.tar.gz .dev/libO.so.gz && have_O=1
spec_O() { in_tree /tmp/treeO spec_line "$@"; }
whole_gpu_suite "$L"
if [ "$h200" = 1 ]; then
  fits 140 "bench" "$L" && bench_8b final 130 1024,32768 fp16
  for round in 1 2; do fits 45 "W$round" "$L" && spec_line "W$round"; done
  [ "$(left "$L")" -gt 90 ] && exllamav2_vs_ours "$(( $(left "$L") - 10 ))"
else
  for round in 1 2; do
    fits 45 "W$round" "$L" && spec_line "W$round"
    [ "$have_O" = 1 ] && fits 45 "O$round" "$L" && spec_O "O$round"
  done
fi
echo "total $(( $(date +%s) - T0 )) s"
