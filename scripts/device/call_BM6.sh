#!/usr/bin/env bash
# RAN in session 50 (H100; docs/performance.md, session 50): "no instruction" the largest stall reason (21-23%).
# Device call BM6 (prepared in session 49, not run; carry .whl and .dev, csrc faef46bdd949; BM6_LIMIT seconds (300)):
# what bounds the 3-bit GEMV's chunk rate. Session 49's BM4 found the 8B's mixed gate/up launches (gate 4:0.1 3:0.9,
# groups of 32 rows) bound by each SM's chunk rate (a block alone on its SM streams 14.5 us, one sharing it 20.0),
# where the 4-bit ones (gate groups of 128) are bound by the bandwidth; by SASS count neither issue, the INT pipe nor
# shared memory is full. Two things to tell apart: the 3-bit decode and the group ends (two per 64-row chunk at 32).
#  1. bench_gemm --m1: 4096x14336 at M = 1 for each width, the mixed gate, and 3 / 4 bits in groups of 32 rows;
#  2. ncu --set full of one such GEMV launch (mixed, 3:1@32, 4:1@128): stall reasons by SASS region (ncu_stalls.py).
export EXL2_CARRIED_LIBRARY=1
source scripts/device/common.sh
begin_card_call bm6 "${BM6_LIMIT:-300}"
timeout 120 python3 scripts/bench_gemm.py --m1 > "$R/gemm_m1.txt" 2>&1
grep -E "^M1 (width|gate)" "$R/gemm_m1.txt" | cut -c1-120
for v in "mixed=4:0.1@32 3:0.9@32" "g32_3=3:1@32" "g128_4=4:1@128"; do
  name=ncu_${v%%=*}
  fits 60 "$name" "$L" || continue
  timeout 90 ncu --clock-control none --set full --import-source no -k "regex:gemv_tma" --launch-skip 2 \
    --launch-count 1 -o "$R/$name" python3 scripts/bench_gemm.py --one --option "${v#*=}" > "$R/$name.log" 2>&1
  ncu_export "$name"
  grep -E "^    Duration|DRAM Throughput|Issue Slots Busy|No Eligible" "$R/$name.details.txt" | head -5
  python3 scripts/ncu_stalls.py "$R/$name.sass.csv.gz" --top 10 --bucket 60 > "$R/$name.stalls.txt" 2>&1
  head -16 "$R/$name.stalls.txt" | cut -c1-160
done
echo "total $(( $(date +%s) - T0 )) s"
