#!/usr/bin/env bash
# Device call E1 (2026-12-02; fresh machine; carry .whl and .dev/libexl2_kernels.so.gz):
#  1. ncu of the small-M GEMV on the 8B shapes (why 4096x14336 reaches ~46% of the read bandwidth and the
#     small linears far less): full section set plus the per-instruction SASS stall table;
#  2. bench_gemm --m1 (current per-shape figures) and the 8B decode/verify kernel tables;
#  3. the GPU tests fixed without a GPU on 2026-12-01 and the rest of the no-SmolLM2 GPU tests;
#  4. ExLlamaV2 0.3.2 loading the converter's own output (2-layer llama3-8b-shape conversion on the GPU).
export EXL2_CARRIED_LIBRARY=1
source scripts/device/common.sh
start_exllamav2_jit
t=$(date +%s)
NCU="ncu --clock-control none --set full --import-source no -k regex:gemv --launch-skip 2 --launch-count 1"
for spec in "0 1" "2 1" "3 1" "4 1" "0 5"; do
  set -- $spec
  name="gemv_s$1_m$2"
  timeout 60 $NCU -o "$OUT/$name" python3 scripts/bench_gemm.py --one --shape $1 --m $2 > "$OUT/$name.log" 2>&1
  ncu --import "$OUT/$name.ncu-rep" --page details > "$OUT/$name.details.txt" 2>&1
  ncu --import "$OUT/$name.ncu-rep" --page source --csv --print-source sass > "$OUT/$name.sass.csv" 2>&1
  grep -E "Duration|DRAM Throughput|Memory Throughput|Achieved Occupancy|Registers Per|Waves Per SM" "$OUT/$name.details.txt" | head -8
done
echo "ncu $(( $(date +%s) - t )) s"; t=$(date +%s)
timeout 90 python3 scripts/bench_gemm.py --m1 2>&1 | tee "$OUT/bench_gemm_m1.txt" | tail -6
python3 -c "from exl2_backend.format.random_model import write_random_exl2_model as w; w('/tmp/models/llama3-8b', 'llama3-8b', bpw=4.0)"
timeout 80 python3 scripts/spec_bench.py --skip smollm2 --kernels --iters 30 --work-dir /tmp/spec_bench \
  --out "$OUT/spec_costs_kernels.json" 2> "$OUT/spec_costs.log"; tail -2 "$OUT/spec_costs.log"
echo "bench $(( $(date +%s) - t )) s"; t=$(date +%s)
timeout 150 python3 -m pytest $CUDA_TESTS_NO_SMOLLM2 -q -m cuda -p no:cacheprovider --timeout 100 -rf 2>&1 | tee "$OUT/cuda_tests_e1.txt" | grep -E "FAILED|passed|failed|Error" | tail -12
echo "tests $(( $(date +%s) - t )) s"; t=$(date +%s)
timeout 90 python3 scripts/convert_timing.py --out "$OUT" --shape llama3-8b --layers 2 --tf32 2>&1 | tail -1
echo "convert $(( $(date +%s) - t )) s"; t=$(date +%s)
wait $JIT; tail -1 "$OUT/exl_jit.txt"
timeout 90 python3 scripts/device/exllamav2_compare.py --out "$OUT" --compat-only /tmp/convert_timing/exl2_llama3-8b_L2 \
  --random-ids 2>&1 | tail -3
echo "compat $(( $(date +%s) - t )) s"
