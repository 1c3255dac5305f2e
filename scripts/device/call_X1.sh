#!/usr/bin/env bash
# Device call X1 (session 14; carry .whl, .dev/libexl2_kernels.so.gz and .dev/libexl2_kernels_onerun.so.gz):
#  1. the 8B decode step at 1k, default library / the EXL2_GEMV_ONE_RUN_BRANCH build interleaved twice (session
#     13's prepared W2: a straight produce / chunk loop for items inside one run), GEMV time by role and widths;
#  2. `bench` at 1k and 32k (fp16 / q8 / q4) before any test run (V3's prefill ran beside orphaned test workers);
#  3. verify costs with the kernel tables of the decode and verify graphs (where k = 4's extra 0.7 ms goes);
#  4. ExLlamaV2 against ours at 1k.
export EXL2_CARRIED_LIBRARY=1
source scripts/device/common.sh
begin_call x1
start_exllamav2_jit
cp "$LIB" /tmp/libD.so && gunzip -c .dev/libexl2_kernels_onerun.so.gz > /tmp/libO.so
interleaved_steps D1 O1 D2 O2
cp /tmp/libD.so "$LIB"
bench_8b final 130 1024,32768 fp16,q8,q4
echo "elapsed $(( $(date +%s) - T0 )) s"
timeout 120 python3 scripts/spec_bench.py --skip smollm2 --iters 30 --kernels --work-dir /tmp/spec_bench \
  --out "$R/spec_kernels.json" 2> "$R/spec_kernels.log"
echo "== spec: $(grep 'step costs' "$R/spec_kernels.log" | tail -1)"
echo "elapsed $(( $(date +%s) - T0 )) s"
if [ "$(left 575)" -gt 80 ]; then exllamav2_vs_ours "$(left 575)"; fi
echo "total $(( $(date +%s) - T0 )) s"
