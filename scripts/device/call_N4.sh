#!/usr/bin/env bash
# Device call N4 (session 9; carry .whl and .dev/libexl2_kernels.so.gz). N3: thread 0's own input loads take
# 3-6 us after every barrier, for the norm's rows (contiguous), the gated gather and a 1-load gather alike, while a
# bulk-copy ring alone streams a 58 MB phase at 3.7 TB/s and 1 GiB at 4.6 TB/s (stream_bench). Where do the warps
# wait at a boundary: the round trip (probe, EXL2_GEMV_CHAIN_STAMPS=2), and ncu's stall samples per instruction of
# the chain kernel and of the gate/up and down launches it replaces.
export EXL2_CARRIED_LIBRARY=1
source scripts/device/common.sh
results_dir
trap '[ -d "$R" ] && pack_results n4' EXIT
t=$(date +%s)
EXL2_GEMV_CHAIN_STAMPS=2 timeout 60 python3 scripts/chain_bench.py --m 1 --json "$R/cb_s2.json" \
  --stamps-out "$R/stamps_s2" > "$R/cb_s2.txt" 2>&1
grep -E "^M=|M=1 phase" "$R/cb_s2.txt" | cut -c1-250
echo "chain bench $(( $(date +%s) - t )) s"; t=$(date +%s)
ncu_chain_once chain gemv_chain 3
ncu_chain_once gateup gemv_tma_kernel 13
ncu_chain_once down gemv_tma_kernel 14
echo "ncu $(( $(date +%s) - t )) s"
