#!/usr/bin/env bash
# Device call W2 (prepared in session 13, not yet run; carry .whl, .dev/libexl2_kernels.so.gz and
# .dev/libexl2_kernels_onerun.so.gz): the measurement build EXL2_GEMV_ONE_RUN_BRANCH (items inside one run take
# their own straight produce / chunk loop, as in session 12) against the default run loop. Session 13: per-run
# launches +0.4-0.6 us with the run loop (V1 B against V4's balanced rows, different calls).
#  1. the 8B decode step at 1k, default / one-run branch interleaved twice, GEMV time by role and bit widths;
#  2. the GEMV GPU tests with the one-run build, if it wins (it then becomes the code).
export EXL2_CARRIED_LIBRARY=1
source scripts/device/common.sh
begin_call w2
LIB=exl2_backend/_lib/libexl2_kernels.so
cp "$LIB" /tmp/libD.so && gunzip -c .dev/libexl2_kernels_onerun.so.gz > /tmp/libO.so
kinds() { grep -A14 "by the launch's bit widths" "$R/prof_$1.txt" | grep -E "^(q/k/v|o|gate/up|down|head) "; }
for v in D1 O1 D2 O2; do
  cp "/tmp/lib${v:0:1}.so" "$LIB"
  decode_step_1k "$v" nochain
  kinds "$v"
done
cp /tmp/libO.so "$LIB"
gpu_tests_verbose kern "$(left 560)" -n 14 $GEMV_GPU_TESTS -k "not llama3_8b"
cp /tmp/libD.so "$LIB"
echo "total $(( $(date +%s) - T0 )) s"
