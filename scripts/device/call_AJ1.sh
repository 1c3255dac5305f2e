#!/usr/bin/env bash
# Device call AJ1 (prepared in session 20, not yet run; carry .whl and .dev/libexl2_kernels.so.gz; ~330 s).
#  1. Where a 2k prefill of the 8B spends the 27-34% it loses with q8 and q4 caches against fp16 (AI5: 34,668 /
#     25,239 / 22,742 tok/s, medians of three in one process): scripts/profile_prefill.py, one model, one engine per
#     cache type, the kernels of one profiled prefill by self time.
#  2. EXL2_GEMV_LEAN=2 (kFDecode: the decode step's one-row GEMVs without the pre-gathered copy, 188 against 191 KB
#     of SASS) against the default lean kernel (L), spec_bench interleaved twice; its GEMV GPU tests.
export EXL2_CARRIED_LIBRARY=1
source scripts/device/common.sh
begin_call aj1
timeout 150 python3 scripts/profile_prefill.py --shape llama3-8b --workdir /tmp/models --cache-types fp16,q8,q4 \
  --top 20 --json "$R/profile_prefill.json" > "$R/profile_prefill.txt" 2>&1
grep -E "^== |^ +[0-9]" "$R/profile_prefill.txt" | cut -c1-160
for round in 1 2; do
  spec_costs L$round
  spec_costs P$round EXL2_GEMV_LEAN=2
done
EXL2_GEMV_LEAN=2 gpu_tests_verbose gemv_lean2 "$(left 570)" -n 12 $GEMV_GPU_TESTS -k "not llama3_8b"
echo "total $(( $(date +%s) - T0 )) s"
