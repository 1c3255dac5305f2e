#!/usr/bin/env bash
# Device call BB1 (prepared in session 35 for the next; carry .whl and .dev/libexl2_kernels.so.gz; ~300 s). Issue 7's
# k = 4 verify costs 1.27-1.29 decode steps against 1.15; of its +640 us over the decode step (H100 AZ1 critical
# path), +215 us are the GEMVs growing with M (the same bytes: 2,027 -> 2,242 us). tests/bench on the H100 (BA1):
# 4096 x 14336 14.08 -> 17.40 us at M = 1 -> 5, 14336 x 4096 15.65 -> 21.25, 4096 x 4096 7.56 -> 10.06. Where
# that goes, per role, before anything is changed:
#  1. ncu --set full of one launch of each shape at M = 1 and M = 5 (scripts/bench_gemm.py --one): duration, DRAM
#     throughput, issue slots, eligible warps, and the stall samples by reason and by code region
#     (scripts/ncu_stalls.py: input stage vs chunk loop vs split-K finish). Shapes: 2 = down 14336 x 4096 (8/4-bit
#     mix), 0 = gate/up 4096 x 14336 (4-bit), 3 = q/o 4096 x 4096.
export EXL2_CARRIED_LIBRARY=1
source scripts/device/common.sh
begin_call bb1
nvidia-smi --query-gpu=name --format=csv,noheader
L=${BB1_LIMIT:-300}
for shape in 2 0 3; do
  for m in 1 5; do
    name="gemv_s${shape}_m$m"
    fits 45 "ncu $name" "$L" || continue
    timeout 45 ncu --clock-control none --set full --import-source no -k "regex:gemv_tma" --launch-skip 2 \
      --launch-count 1 -o "$R/$name" python3 scripts/bench_gemm.py --one --shape "$shape" --m "$m" \
      > "$R/$name.log" 2>&1
    ncu_export "$name"
    echo "== $name"
    grep -E "^    Duration|DRAM Throughput|Issue Slots Busy|Eligible Warps|Registers Per|Achieved Occupancy" \
      "$R/$name.details.txt" | head -6
    python3 scripts/ncu_stalls.py "$R/$name.sass.csv.gz" --top 8 --bucket 150 > "$R/$name.stalls.txt" 2>&1
    head -14 "$R/$name.stalls.txt" | cut -c1-150
  done
done
echo "total $(( $(date +%s) - T0 )) s"
