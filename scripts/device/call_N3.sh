#!/usr/bin/env bash
# Device call N3 (session 9; carry .whl, .dev/libexl2_kernels.so.gz and .dev/stream_bench). N2: ring size (16-48 KB), holding the
# producer until the barrier and polling without back-off left every phase boundary of the chain where it was
# (input 3.5-6.5 us, finish ~2, the barrier's own latency ~2); second-slot blocks stream ~28% slower in gate/up.
# Now: where the input stage's time goes (stamp 5: thread 0's loads returned) and one L2 round trip right after
# the barrier (stamp 4, EXL2_GEMV_CHAIN_STAMPS=2), M = 1 and 2.
export EXL2_CARRIED_LIBRARY=1
source scripts/device/common.sh
results_dir
trap '[ -d "$R" ] && pack_results n3' EXIT
t=$(date +%s)
gpu_tests chain 100 tests/kernels/test_gemv_chain.py --timeout 80
echo "tests $(( $(date +%s) - t )) s"; t=$(date +%s)
cb() {  # name, then environment assignments
  local name=$1; shift
  env "$@" timeout 60 python3 scripts/chain_bench.py --m 1,2 --json "$R/cb_$name.json" \
    --stamps-out "$R/stamps_$name" > "$R/cb_$name.txt" 2>&1
  echo "== $name"; grep -E "^M=|M=1 phase" "$R/cb_$name.txt" | cut -c1-250
}
cb s1 EXL2_GEMV_CHAIN_STAMPS=1
cb s2 EXL2_GEMV_CHAIN_STAMPS=2
echo "chain bench $(( $(date +%s) - t )) s"
# The weight-streaming pattern alone (scripts/device/stream_bench.cu, built here and carried as .dev/stream_bench):
# does a bulk-copy ring of 8 KB copies reach the 4.2 TB/s of a large reduction, at one phase's size?
t=$(date +%s)
timeout 60 .dev/stream_bench 2>&1 | tee "$R/stream_bench.txt"
echo "stream bench $(( $(date +%s) - t )) s"
