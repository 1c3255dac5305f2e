#!/usr/bin/env bash
# Device call AG2 (session 18; carry .whl and .dev/libexl2_kernels.so.gz; ~560 s). AG1 measured the split norm
# slower: decode 2.426 against 2.359 ms without it, the k = 4 verify 1.318 against 1.265 (and the library without
# the split 60 us slower than AF3's). Since then: the producer keeps its final values in shared memory and loads
# the residual while the partials are summed (AG1 re-read its output from L2 after a barrier); the consumer's gather
# is one copy of the code (the TMA kernel's SASS had grown 34%); from two rows the producer also writes the stream
# in the consumer's stored order, which the consumer copies with 16-byte loads (AG1's consumers gathered M rows two
# bytes at a time where the pre-gathering norm had written them).
#  1. GPU tests of the norms (split, fused, pre-gathering, rms_norm) and the model forward with the split on / off;
#  2. verify / decode step costs, interleaved twice: the default (stored order from 2 rows), stored order from 1
#     row, never, and no split;
#  3. the critical path of the decode and k = 4 verify graphs kernel by kernel (spec_bench --kernels);
#  4. `bench` at 1k and 32k (fp16 / q8 / q4);
#  5. the engine's and speculation's GPU tests, the fused rope and chain tests.
export EXL2_CARRIED_LIBRARY=1
source scripts/device/common.sh
begin_call ag2
gpu_tests_verbose norms 130 -n 12 tests/kernels/test_gemv_split_norm.py tests/kernels/test_gemv_norm.py \
  tests/kernels/test_layers.py -k "split or norm"
echo "elapsed $(( $(date +%s) - T0 )) s"
for round in 1 2; do
  spec_costs stored2_$round
  spec_costs stored1_$round EXL2_BACKEND_SPLIT_NORM_STORED_FROM=1
  spec_costs gather_$round EXL2_BACKEND_SPLIT_NORM_STORED_FROM=0
  spec_costs nosplit_$round EXL2_BACKEND_SPLIT_NORM=0
done
echo "elapsed $(( $(date +%s) - T0 )) s"
timeout 100 python3 scripts/spec_bench.py --skip smollm2 --iters 30 --kernels --work-dir /tmp/spec_bench \
  --out "$R/spec_kernels.json" > "$R/spec_kernels.txt" 2>&1
echo "== spec kernels: $(grep 'step costs' "$R/spec_kernels.txt" | tail -1 | cut -c1-200)"
python3 -c "
import json, sys
c = json.load(open('$R/spec_kernels.json'))['costs_8b']['critical']
for g in ('decode', 'verify_k4'):
    print(g, '  '.join(f'{k[:28]} {v[0]:.0f}x {v[1]:.0f}' for k, v in sorted(c[g].items(), key=lambda kv: -kv[1][1])))
" 2>&1 | cut -c1-400
echo "elapsed $(( $(date +%s) - T0 )) s"
bench_8b final 130 1024,32768 fp16,q8,q4
echo "elapsed $(( $(date +%s) - T0 )) s"
gpu_tests_verbose engine "$(left 555)" -n 12 tests/engine/test_gpu_parity.py tests/spec/test_spec_cuda.py \
  tests/kernels/test_gemv_rope_kv.py tests/serve/test_batch_invariance.py tests/kernels/test_gemv_chain.py
echo "total $(( $(date +%s) - T0 )) s"
