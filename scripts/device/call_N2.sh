#!/usr/bin/env bash
# Device call N2 (session 9; carry .whl and .dev/libexl2_kernels.so.gz). N1's stamps: every phase boundary of the
# GEMV chain costs ~10 us (input 3.5-5.5 us, finish 2-3, the last finish -> first block through the barrier
# 2-3, the finishes spread ~4-6 us), about five dependent round trips of ~2 us: the ring's copies in flight
# (32 KB x 264 blocks = 8.4 MB, 2 us at 4.2 TB/s) set the queueing latency of every other load.
#  1. the chain's tests with the producer held until the barrier (EXL2_GEMV_CHAIN_HOLD=1);
#  2. chain_bench (apart and chain, stamps) for ring 16 / 24 / 32 / 48 KB, held, polling without back-off;
#  3. the 8B decode step (profile_decode, launches one by one) for ring 16 / 24 / 32, and the chain at ring 16.
export EXL2_CARRIED_LIBRARY=1
source scripts/device/common.sh
results_dir
trap '[ -d "$R" ] && pack_results n2' EXIT
t=$(date +%s)
EXL2_GEMV_CHAIN_HOLD=1 gpu_tests chain_hold 100 tests/kernels/test_gemv_chain.py --timeout 80
echo "tests $(( $(date +%s) - t )) s"; t=$(date +%s)
cb() {  # name, then environment assignments
  local name=$1; shift
  env EXL2_GEMV_CHAIN_STAMPS=1 "$@" timeout 60 python3 scripts/chain_bench.py --m 1,5 --json "$R/cb_$name.json" \
    --stamps-out "$R/stamps_$name" > "$R/cb_$name.txt" 2>&1
  echo "== $name"; grep -E "^M=|M=1 phase" "$R/cb_$name.txt" | cut -c1-200
}
cb r32
cb r32hold EXL2_GEMV_CHAIN_HOLD=1
cb r32spin EXL2_GEMV_CHAIN_SPIN=1
cb r16 EXL2_GEMV_RING_KB=16
cb r16hold EXL2_GEMV_RING_KB=16 EXL2_GEMV_CHAIN_HOLD=1
cb r24 EXL2_GEMV_RING_KB=24
cb r48 EXL2_GEMV_RING_KB=48
echo "chain bench $(( $(date +%s) - t )) s"; t=$(date +%s)
decode_step_1k r32 nochain
decode_step_1k r16 nochain EXL2_GEMV_RING_KB=16
decode_step_1k r24 nochain EXL2_GEMV_RING_KB=24
decode_step_1k r16chain after EXL2_BACKEND_GEMV_CHAIN=1 EXL2_GEMV_RING_KB=16 EXL2_GEMV_CHAIN_HOLD=1
echo "profile $(( $(date +%s) - t )) s"
