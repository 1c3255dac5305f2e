#!/usr/bin/env bash
# Device call V4 (session 13; carry .whl and .dev/libexl2_kernels.so.gz): span splits only where they pay (the
# per-run plan needs several waves, or span items are >= 15% shorter), one-run items on the per-run walk, and the
# fix of V3's per-run walk (GvWork::re was set before the run search: balanced, cluster and chain GEMVs skipped
# every run past the first).
#  1. test_gemm_torch_compile alone (failed in V1 and V3 beside other workers, unnamed in V1);
#  2. the 8B decode step at 1k: span twice, balanced once;
#  3. the GEMV GPU tests, verbose;  4. `bench` at 1k, fp16, if time is left.
export EXL2_CARRIED_LIBRARY=1
source scripts/device/common.sh
begin_call v4
timeout 60 python3 -m pytest -q -x -m cuda -p no:cacheprovider tests/kernels/test_exl2_gemm.py -k torch_compile \
  > "$R/compile.txt" 2>&1; tail -25 "$R/compile.txt" | cut -c1-200
kinds() { grep -A14 "by the launch's bit widths" "$R/prof_$1.txt" | grep -E "^(q/k/v|o|gate/up|down|head) "; }
roles() { grep -A7 "GEMVs by role" "$R/prof_$1.txt" | tail -5; }
decode_step_1k span1 nochain; roles span1; kinds span1
decode_step_1k bal1 nochain EXL2_BACKEND_GEMV_SPLITS=balanced; roles bal1; kinds bal1
decode_step_1k span2 nochain; roles span2
echo "steps $(( $(date +%s) - T0 )) s"
gpu_tests_verbose kern "$(left 300)" -n 14 $GEMV_GPU_TESTS -k "not llama3_8b"
echo "tests $(( $(date +%s) - T0 )) s"
if [ "$(left 370)" -gt 70 ]; then bench_8b final 70 1024 fp16; fi
echo "total $(( $(date +%s) - T0 )) s"
