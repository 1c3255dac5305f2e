#!/usr/bin/env bash
# Device call BD1 (session 37; carry .whl, .dev/libexl2_kernels.so.gz and .dev/persistent_bound, built here from
# scripts/device/persistent_bound.cu as its header says; ~240 s). No library change. The question: can a persistent
# decode kernel stream the step's GEMV weights through its 128 all-to-all phase boundaries near the streaming
# ceiling (issue 3's 80% needs it), or does each boundary cost what a launch boundary costs today?
#  1. persistent_bound: one launch with the step's 3.49 GB in 128 dependent phases, ring depth 24-192 KB per block,
#     1 or 2 blocks per SM, against the same ring with no dependencies, plain loads, and 128 PDL launches in a graph.
#  2. chain_bench --m 1: the library's persistent chain (grid barriers, a ring planned per work item) against the
#     launches one by one, on this card, for the same layer's four GEMVs.
export EXL2_CARRIED_LIBRARY=1
source scripts/device/common.sh
begin_call bd1
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader
timeout 240 .dev/persistent_bound 2>&1 | tee "$R/persistent_bound.txt"
echo "elapsed $(( $(date +%s) - T0 )) s"
fits 150 "chain_bench" 420 && timeout 150 python3 scripts/chain_bench.py --m 1 --json "$R/chain_bench.json" 2>&1 \
  | tail -12 | tee "$R/chain_bench.txt"
echo "elapsed $(( $(date +%s) - T0 )) s"
