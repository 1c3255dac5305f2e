#!/usr/bin/env bash
# Device call AH2 (session 19; carry .whl and .dev/libexl2_kernels.so.gz; ~420 s). The norm at the end of the GEMV
# before it (exl2_gemv_norm_tail, csrc/quant/exl2_gemv_norm_tail.cuh, C ABI 10): in a step of M >= 3 rows o_proj
# and down_proj run the next GEMV's pre-gathering norm in their own launch, 63 of the k = 4 verify's 65 norm
# launches (305 us of its critical path in AF3) gone. The default kernels are instruction-identical to session 17's.
#  1. the tail's GPU tests, and those of the fused norm and rope it sits beside;
#  2. verify / decode step costs interleaved twice: the tail on (T, the default) and off (O,
#     EXL2_BACKEND_NORM_TAIL=0), then the verify's critical path per kernel with the tail;
#  3. `bench` at 1k with the tail (decode steps do not use it: M = 1).
export EXL2_CARRIED_LIBRARY=1
source scripts/device/common.sh
begin_call ah2
gpu_tests_verbose tail_tests 150 -n 8 tests/kernels/test_gemv_norm_tail.py tests/kernels/test_gemv_norm.py \
  tests/kernels/test_gemv_rope_kv.py
echo "elapsed $(( $(date +%s) - T0 )) s"
for round in 1 2; do
  spec_costs T$round
  spec_costs O$round EXL2_BACKEND_NORM_TAIL=0
done
timeout 60 python3 scripts/spec_bench.py --skip smollm2 --iters 30 --kernels --work-dir /tmp/spec_bench \
  --out "$R/spec_kernels.json" > "$R/spec_kernels.txt" 2>&1
echo "== spec kernels: $(grep 'step costs' "$R/spec_kernels.txt" | tail -1 | cut -c1-200)"
python3 -c "
import json
c = json.load(open('$R/spec_kernels.json'))['costs_8b']['critical']
for g in ('decode', 'verify_k4'):
    print(g, '  '.join(f'{k[:28]} {v[0]:.0f}x {v[1]:.0f}' for k, v in sorted(c[g].items(), key=lambda kv: -kv[1][1])))
" 2>&1 | cut -c1-400
echo "elapsed $(( $(date +%s) - T0 )) s"
if [ "$(left 420)" -gt 60 ]; then bench_8b tail "$(left 415)" 1024 fp16; fi
echo "total $(( $(date +%s) - T0 )) s"
