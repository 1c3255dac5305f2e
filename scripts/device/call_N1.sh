#!/usr/bin/env bash
# Device call N1 (prepared in session 8 for the next one; carry .whl and .dev/libexl2_kernels.so.gz): the GEMV
# chain's grid barrier rewritten after M1 / M3 (count and generation on separate lines, relaxed polls with
# back-off, acq_rel fences), not yet run on a GPU.
#  1. the chain's tests (the 8B layer at M = 5 with norm phases is an expected failure until explained);
#  2. scripts/chain_bench.py with per-phase stamps (input / chunks / finish / barrier; M3 with the old barrier, us per layer: M = 1 apart 61.3 / chain 91.0 / grid 132
#     128.8 / three phases 86.2; M = 5 73.8 / 113.5 / 142.2 / 106.0);
#  3. if the chain now wins: the 8B decode step with and without it (profile_decode after,nochain with
#     EXL2_BACKEND_GEMV_CHAIN=1 for "after").
export EXL2_CARRIED_LIBRARY=1
source scripts/device/common.sh
results_dir
trap '[ -d "$R" ] && pack_results n1' EXIT
t=$(date +%s)
gpu_tests chain 100 tests/kernels/test_gemv_chain.py --timeout 80
echo "tests $(( $(date +%s) - t )) s"; t=$(date +%s)
EXL2_GEMV_CHAIN_STAMPS=1 timeout 60 python3 scripts/chain_bench.py --m 1,2,5 --json "$R/chain_bench.json" 2>&1 | tee "$R/chain_bench.txt" \
  | tail -8
echo "chain bench $(( $(date +%s) - t )) s"; t=$(date +%s)
EXL2_BACKEND_GEMV_CHAIN=1 timeout 80 python3 scripts/profile_decode.py --shapes llama3-8b --variants after,nochain \
  --workdir /tmp/prof --context 1024 --cache-types fp16 --out "$R/p1k" > "$R/profile_1k.txt" 2>&1
grep -E "^######## |graph before" "$R/profile_1k.txt" | head -6
echo "profile $(( $(date +%s) - t )) s"
