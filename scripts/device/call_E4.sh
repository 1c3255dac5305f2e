#!/usr/bin/env bash
# Device call E4 (2026-12-02; carry .whl and .dev/libexl2_kernels.so.gz): the TMA GEMV with the staged-scale
# group count fixed (a last chunk whose unit 0 ends a group touches one more group) and a 32 KB ring (E3 sweep).
export EXL2_CARRIED_LIBRARY=1
source scripts/device/common.sh
results_dir
t=$(date +%s)
timeout 60 python3 -m pytest tests/kernels/test_exl2_gemm.py -q -m cuda -p no:cacheprovider --timeout 60 -rf 2>&1 \
  | tee "$R/gemm_tests.txt" | grep -E "FAILED|passed|failed|Error" | tail -4
timeout 70 python3 -m pytest tests/serve/test_batch_invariance.py tests/unit/test_convert_device.py -q -m cuda \
  -p no:cacheprovider --timeout 60 -rf 2>&1 | tee "$R/more_tests.txt" | grep -E "FAILED|passed|failed|Error" | tail -4
echo "tests $(( $(date +%s) - t )) s"; t=$(date +%s)
timeout 30 python3 scripts/bench_gemm.py --m1 2>&1 | tee "$R/m1.txt" | grep M1
timeout 70 python3 scripts/profile_decode.py --shapes llama3-8b --variants after --workdir /tmp/prof --no-check \
  --out "$R" > "$R/profile_decode.txt" 2>&1; grep -E "########|!!" "$R/profile_decode.txt" | head -2
timeout 70 python3 -m exl2_backend.cli.main bench --shape llama3-8b --bpw 4.0 --model-out /tmp/models/llama3-8b \
  --contexts 1024,32768 --cache-type fp16,q8,q4 --json "$R/bench_8b.json" --plot "$R/bench_8b.png" > "$R/bench_8b.txt" 2>&1
grep -A6 "decode tokens/s by cache" "$R/bench_8b.txt" | tail -3
timeout 45 python3 scripts/spec_bench.py --skip smollm2 --iters 30 --work-dir /tmp/spec_bench \
  --out "$R/spec_costs.json" 2> "$R/spec_costs.log"; grep "step costs" "$R/spec_costs.log" | tail -1
echo "bench $(( $(date +%s) - t )) s"
pack_results e4
