#!/usr/bin/env bash
# Device call V3 (session 13; as run, before common.sh stopped leftover test workers; carry .whl and .dev/libexl2_kernels.so.gz), the session's final library: 3-bit whole
# fields, scales staged by the smallest group, span splits whose blocks read no run bounds when an item stays in
# one run (V2's span kernel read them through indexed constant loads before its first copy: +0.3-0.5 us per GEMV)
# and compute them in 32-bit arithmetic.
#  1. the 8B decode step at 1k: span twice, balanced once;
#  2. the GEMV GPU tests, verbose (every result named as it comes);
#  3. `bench` at 1k and 32k (fp16 / q8 / q4), verify costs, ExLlamaV2 0.3.2 at 1k beside ours.
export EXL2_CARRIED_LIBRARY=1
source scripts/device/common.sh
begin_call v3
start_exllamav2_jit
kinds() { grep -A14 "by the launch's bit widths" "$R/prof_$1.txt" | grep -E "^(q/k/v|o|gate/up|down|head) "; }
roles() { grep -A7 "GEMVs by role" "$R/prof_$1.txt" | tail -5; }
decode_step_1k span1 nochain; roles span1; kinds span1
decode_step_1k bal1 nochain EXL2_BACKEND_GEMV_SPLITS=balanced; roles bal1
decode_step_1k span2 nochain; roles span2
echo "steps $(( $(date +%s) - T0 )) s"
gpu_tests_verbose kern "$(left 250)" -n 14 $GEMV_GPU_TESTS -k "not llama3_8b"
echo "tests $(( $(date +%s) - T0 )) s"
final_figures 575
echo "total $(( $(date +%s) - T0 )) s"
