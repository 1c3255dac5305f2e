#!/usr/bin/env bash
# Device call BC6 (session 36; carry .whl and .dev/libexl2_kernels.so.gz; ~150 s). Why the streamed attention over
# code pages on tensor cores (EXL2_BACKEND_ATTN_STREAM_QUANT=1) takes ~2.6 us per 16-token chunk at 32k (q8 42.8 us
# per layer, q4 41.0; BC3 / BC5) whatever the bytes in flight: ncu --set full of one launch for q8 and q4, the
# stall samples by reason and code region (scripts/ncu_stalls.py).
export EXL2_CARRIED_LIBRARY=1
source scripts/device/common.sh
begin_call bc6
L=${BC6_LIMIT:-150}
for ct in q8 q4; do
  fits 60 "ncu $ct" "$L" || continue
  EXL2_BACKEND_ATTN_STREAM_QUANT=1 timeout 60 ncu --clock-control none --set full --import-source no \
    -k "regex:stream_mma_quant" --launch-skip 1 --launch-count 1 -o "$R/qmma_$ct" python3 scripts/attention_once.py \
    --cache-type "$ct" --context 32768 > "$R/qmma_$ct.log" 2>&1
  ncu_export "qmma_$ct"
  echo "== qmma_$ct"
  grep -E "^    Duration|DRAM Throughput|Issue Slots Busy|Eligible Warps|Registers Per|Achieved Occupancy|Shared Memory" \
    "$R/qmma_$ct.details.txt" | head -9
  python3 scripts/ncu_stalls.py "$R/qmma_$ct.sass.csv.gz" --top 10 --bucket 100 > "$R/qmma_$ct.stalls.txt" 2>&1
  head -26 "$R/qmma_$ct.stalls.txt" | cut -c1-160
done
echo "total $(( $(date +%s) - T0 )) s"
