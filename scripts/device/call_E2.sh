#!/usr/bin/env bash
# Device call E2 (2026-12-02; carry .whl and .dev/libexl2_kernels.so.gz): the TMA-ring small-M GEMV.
#  1. the GEMM/GEMV kernel tests (TMA ring, register batches, ring wrap), then the other no-SmolLM2 GPU tests;
#  2. bench_gemm --m1 for the TMA ring and the register-batch kernel, and ncu of the TMA kernel;
#  3. the 8B decode step's kernel table (TMA vs register batches), verify costs, and `bench` on the 8B/1B shapes.
# Everything lands in one archive ($OUT takes at most 8 files).
export EXL2_CARRIED_LIBRARY=1
source scripts/device/common.sh
results_dir
t=$(date +%s)
timeout 120 python3 -m pytest tests/kernels/test_exl2_gemm.py -q -m cuda -p no:cacheprovider --timeout 60 -x -rf 2>&1 \
  | tee "$R/gemm_tests.txt" | grep -E "FAILED|passed|failed|Error" | tail -6
echo "gemm tests $(( $(date +%s) - t )) s"; t=$(date +%s)
for v in 0 2; do
  EXL2_BACKEND_GEMV_MINB=$v timeout 60 python3 scripts/bench_gemm.py --m1 2>&1 | tee "$R/bench_gemm_m1_minb$v.txt" | grep M1
done
for spec in "0 1" "3 1" "0 5"; do
  set -- $spec; name="tma_s$1_m$2"
  timeout 60 ncu --clock-control none --set full -k regex:gemv --launch-skip 2 --launch-count 1 -o "$R/$name" \
    python3 scripts/bench_gemm.py --one --shape $1 --m $2 > "$R/$name.log" 2>&1
  ncu --import "$R/$name.ncu-rep" --page details > "$R/$name.details.txt" 2>&1
  ncu --import "$R/$name.ncu-rep" --page source --csv --print-source sass > "$R/$name.sass.csv" 2>&1
  rm -f "$R/$name.ncu-rep"
  grep -E "^    Duration|DRAM Throughput|Achieved Occupancy" "$R/$name.details.txt" | head -3
done
echo "kernel bench $(( $(date +%s) - t )) s"; t=$(date +%s)
timeout 150 python3 scripts/profile_decode.py --shapes llama3-8b --variants after,regbatch --workdir /tmp/prof \
  --out "$R" > "$R/profile_decode.txt" 2>&1; grep -E "########|greedy|!!" "$R/profile_decode.txt" | head -6
echo "profile $(( $(date +%s) - t )) s"; t=$(date +%s)
timeout 100 python3 -m exl2_backend.cli.main bench --shape llama3-8b --bpw 4.0 --model-out /tmp/models/llama3-8b \
  --contexts 1024,32768 --cache-type fp16,q8,q4 --json "$R/bench_8b.json" --plot "$R/bench_8b.png" > "$R/bench_8b.txt" 2>&1
tail -12 "$R/bench_8b.txt"
timeout 60 python3 -m exl2_backend.cli.main bench --shape llama3-1b --bpw 4.0 --model-out /tmp/models/llama3-1b \
  --contexts 1024 --json "$R/bench_1b.json" > "$R/bench_1b.txt" 2>&1; tail -4 "$R/bench_1b.txt"
echo "bench $(( $(date +%s) - t )) s"; t=$(date +%s)
timeout 60 python3 scripts/spec_bench.py --skip smollm2 --kernels --iters 30 --work-dir /tmp/spec_bench \
  --out "$R/spec_costs_kernels.json" 2> "$R/spec_costs.log"; tail -1 "$R/spec_costs.log"
echo "spec $(( $(date +%s) - t )) s"; t=$(date +%s)
timeout 150 python3 -m pytest $CUDA_TESTS_NO_SMOLLM2 -q -m cuda -p no:cacheprovider --timeout 100 -rf 2>&1 \
  | tee "$R/cuda_tests.txt" | grep -E "FAILED|passed|failed|Error" | tail -8
echo "tests $(( $(date +%s) - t )) s"
pack_results e2
