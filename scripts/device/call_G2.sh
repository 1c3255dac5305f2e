#!/usr/bin/env bash
# Device call G2 (after G1 on the warm machine; carry .whl and .dev/): long-context decode by cache type with the
# 8-bit attention at 8 elements per lane (issue 6: q8 was slower than fp16 at 32k), the 4-bit one at 8 elements
# too (a measurement build, .dev/libexl2_kernels_q4e8.so.gz), ncu of both, and the prefix-cache time to first
# token with the new routing defaults. (The q4e8 build came from a compile-time switch in paged_attention_quant.cu
# that was removed after this call: 8 elements per lane lost for 4-bit codes.)
export EXL2_CARRIED_LIBRARY=1
source scripts/device/common.sh
results_dir
t=$(date +%s)
timeout 110 python3 -m exl2_backend.cli.main bench --shape llama3-8b --bpw 4.0 --model-out /tmp/models/llama3-8b \
  --contexts 1024,32768 --cache-type fp16,q8,q4 --json "$R/bench_8b.json" --plot "$R/bench_8b.png" > "$R/bench_8b.txt" 2>&1
grep -A6 "decode tokens/s by cache" "$R/bench_8b.txt" | tail -4
gunzip -c .dev/libexl2_kernels_q4e8.so.gz > /tmp/libq4e8.so
EXL2_BACKEND_LIBRARY=/tmp/libq4e8.so timeout 70 python3 -m exl2_backend.cli.main bench --shape llama3-8b --bpw 4.0 \
  --model-out /tmp/models/llama3-8b --contexts 32768 --cache-type q4 --json "$R/bench_8b_q4e8.json" \
  > "$R/bench_8b_q4e8.txt" 2>&1
echo "q4 at 8 elements per lane:"; grep -A4 "decode tokens/s by cache" "$R/bench_8b_q4e8.txt" | tail -2
echo "bench $(( $(date +%s) - t )) s"; t=$(date +%s)
for ct in q8 q4 q4e8; do
  lib=""; c=$ct; [ $ct = q4e8 ] && { lib=/tmp/libq4e8.so; c=q4; }
  EXL2_BACKEND_LIBRARY=$lib timeout 45 ncu --clock-control none --set full -k regex:paged_attention --launch-skip 1 \
    --launch-count 1 -o "$R/attn_$ct" python3 scripts/attention_once.py --cache-type $c --context 32768 \
    > "$R/attn_$ct.log" 2>&1
  ncu --import "$R/attn_$ct.ncu-rep" --page details > "$R/attn_$ct.details.txt" 2>&1; rm -f "$R/attn_$ct.ncu-rep"
  echo "$ct: $(grep -E '^    Duration|DRAM Throughput|Issue Slots Busy|Registers Per|Achieved Occ' "$R/attn_$ct.details.txt" \
    | tr -s ' ' | tr '\n' ';')"
done
echo "ncu $(( $(date +%s) - t )) s"; t=$(date +%s)
timeout 90 python3 scripts/prefix_prefill.py /tmp/models/llama3-8b --long 0 --json "$R/prefix.json" > "$R/prefix.txt" 2>&1
tail -2 "$R/prefix.txt"
echo "prefix $(( $(date +%s) - t )) s"; t=$(date +%s)
# issue 3: the 1B and 70B shapes (random 4.0 bpw, fp16 cache, 1k context)
for sh in llama3-1b llama3-70b; do
  timeout 150 python3 -m exl2_backend.cli.main bench --shape $sh --bpw 4.0 --model-out /tmp/models/$sh --contexts 1024 \
    --json "$R/bench_$sh.json" > "$R/bench_$sh.txt" 2>&1
  echo "$sh: $(grep -A4 "decode tokens/s by cache" "$R/bench_$sh.txt" | tail -2 | tr '\n' ' ')"
  rm -rf /tmp/models/$sh
done
echo "shapes $(( $(date +%s) - t )) s"
pack_results g2
