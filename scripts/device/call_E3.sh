#!/usr/bin/env bash
# Device call E3 (2026-12-02; carry .whl and .dev/libexl2_kernels.so.gz): the TMA-ring GEMV with staged scales.
#  1. GEMM/GEMV kernel tests; 2. ring-size sweep (bench_gemm --m1 per EXL2_GEMV_RING_KB), the best total used
#  below; 3. ncu of 4096x14336 M=1; 4. decode-step kernel tables (TMA vs register batches), `bench` 8B/1B,
#  verify costs; 5. the multi-GPU allocator test alone, then the other no-SmolLM2 GPU tests. One archive back.
export EXL2_CARRIED_LIBRARY=1
source scripts/device/common.sh
results_dir
t=$(date +%s)
timeout 100 python3 -m pytest tests/kernels/test_exl2_gemm.py -q -m cuda -p no:cacheprovider --timeout 60 -rf 2>&1 \
  | tee "$R/gemm_tests.txt" | grep -E "FAILED|passed|failed|Error" | tail -6
echo "gemm tests $(( $(date +%s) - t )) s"; t=$(date +%s)
EXL2_BACKEND_GEMV_MINB=2 timeout 40 python3 scripts/bench_gemm.py --m1 > "$R/m1_regbatch.txt" 2>&1
for kb in 16 24 32 48 64 96; do
  EXL2_GEMV_RING_KB=$kb timeout 40 python3 scripts/bench_gemm.py --m1 > "$R/m1_ring$kb.txt" 2>&1
done
for f in "$R"/m1_*.txt; do
  echo "$(basename $f .txt): $(grep M1 $f | awk '{s+=$(NF-10)} END {printf "%.2f", s}') us total; $(grep M1 $f | awk '{printf "%s ", $(NF-10)}')"
done | tee "$R/sweep.txt"
BEST=$(grep ring "$R/sweep.txt" | sort -t: -k2 -n | head -1 | sed -E 's/m1_ring([0-9]+).*/\1/')
export EXL2_GEMV_RING_KB=${BEST:-48}; echo "ring $EXL2_GEMV_RING_KB KB"
echo "sweep $(( $(date +%s) - t )) s"; t=$(date +%s)
timeout 50 ncu --clock-control none --set full -k regex:gemv --launch-skip 2 --launch-count 1 -o "$R/tma_s0_m1" \
  python3 scripts/bench_gemm.py --one --shape 0 --m 1 > "$R/ncu.log" 2>&1
ncu --import "$R/tma_s0_m1.ncu-rep" --page details > "$R/tma_s0_m1.details.txt" 2>&1
ncu --import "$R/tma_s0_m1.ncu-rep" --page source --csv --print-source sass > "$R/tma_s0_m1.sass.csv" 2>&1
rm -f "$R/tma_s0_m1.ncu-rep"; grep -E "^    Duration|DRAM Throughput" "$R/tma_s0_m1.details.txt" | head -2
timeout 120 python3 scripts/profile_decode.py --shapes llama3-8b --variants after,regbatch --workdir /tmp/prof \
  --out "$R" > "$R/profile_decode.txt" 2>&1; grep -E "########|!!" "$R/profile_decode.txt" | head -4
timeout 100 python3 -m exl2_backend.cli.main bench --shape llama3-8b --bpw 4.0 --model-out /tmp/models/llama3-8b \
  --contexts 1024,32768 --cache-type fp16,q8,q4 --json "$R/bench_8b.json" --plot "$R/bench_8b.png" > "$R/bench_8b.txt" 2>&1
grep -A6 "decode tokens/s by cache" "$R/bench_8b.txt" | tail -3
timeout 60 python3 -m exl2_backend.cli.main bench --shape llama3-1b --bpw 4.0 --model-out /tmp/models/llama3-1b \
  --contexts 1024 --json "$R/bench_1b.json" > "$R/bench_1b.txt" 2>&1
timeout 60 python3 scripts/spec_bench.py --skip smollm2 --kernels --iters 30 --work-dir /tmp/spec_bench \
  --out "$R/spec_costs_kernels.json" 2> "$R/spec_costs.log"; grep "step costs" "$R/spec_costs.log" | tail -1
echo "decode $(( $(date +%s) - t )) s"; t=$(date +%s)
timeout 60 python3 -m pytest tests/multigpu/test_multigpu_cuda.py -q -m cuda -p no:cacheprovider -k allocator -rf \
  > "$R/alloc_alone.txt" 2>&1; tail -1 "$R/alloc_alone.txt"
timeout 130 python3 -m pytest $CUDA_TESTS_NO_SMOLLM2 -q -m cuda -p no:cacheprovider --timeout 100 -rf \
  --deselect tests/kernels/test_exl2_gemm.py 2>&1 | tee "$R/cuda_tests.txt" | grep -E "FAILED|passed|failed|Error" | tail -6
echo "tests $(( $(date +%s) - t )) s"
pack_results e3
