#!/usr/bin/env bash
# Device call AJ1 (prepared in session 20, not yet run; carry .whl, .dev/libexl2_kernels.so.gz and
# .dev/libexl2_kernels_timeline.so.gz (scripts/build_variant.sh EXL2_GEMV_TIMELINE ...); ~400 s).
#  1. Where a 2k prefill of the 8B spends the 27-34% it loses with q8 and q4 caches against fp16 (AI5: 34,668 /
#     25,239 / 22,742 tok/s, medians of three in one process): scripts/profile_prefill.py, one model, one engine per
#     cache type, the kernels of one profiled prefill by self time.
#  2. EXL2_GEMV_LEAN=2 (kFDecode: the decode step's one-row GEMVs without the pre-gathered copy, 188 against 191 KB
#     of SASS) against the default lean kernel (L), spec_bench interleaved twice.
#  3. The decode step's GEMV launches block by block (scripts/gemv_timeline.py on the -DEXL2_GEMV_TIMELINE library):
#     per role the gap after the previous GEMV, the PDL wait, input staging, streaming, split-K finish and tail, i.e.
#     where the ~6-8 us per launch that moves no weights goes inside the real decode graph.
#  4. The GEMV GPU tests with EXL2_GEMV_LEAN=2, in what time is left.
export EXL2_CARRIED_LIBRARY=1
source scripts/device/common.sh
begin_call aj1
use_libraries T=.dev/libexl2_kernels_timeline.so.gz
timeout 150 python3 scripts/profile_prefill.py --shape llama3-8b --workdir /tmp/models --cache-types fp16,q8,q4 \
  --top 20 --json "$R/profile_prefill.json" > "$R/profile_prefill.txt" 2>&1
grep -E "^== |^ +[0-9]" "$R/profile_prefill.txt" | cut -c1-160
for round in 1 2; do
  spec_costs L$round
  spec_costs P$round EXL2_GEMV_LEAN=2
done
cp /tmp/libT.so "$LIB"
timeout 90 python3 scripts/gemv_timeline.py --workdir /tmp/models --json "$R/timeline.json" > "$R/timeline.txt" 2>&1
cp /tmp/libD.so "$LIB"
cat "$R/timeline.txt" | tail -12
echo "elapsed $(( $(date +%s) - T0 )) s"
EXL2_GEMV_LEAN=2 gpu_tests_verbose gemv_lean2 "$(left 570)" -n 12 $GEMV_GPU_TESTS -k "not llama3_8b"
echo "total $(( $(date +%s) - T0 )) s"
