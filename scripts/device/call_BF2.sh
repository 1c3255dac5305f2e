#!/usr/bin/env bash
# Device call BF2 (session 40; carry .whl and .dev; ~9.5 min): BF1's GEMV GPU tests with the repeat test
# (eac2fbf moved the chain tests' 8B layer and inputs into helpers; BF1 found no machine) beside the lazy running
# max of the one-pass attention kernels (kLazyMaxLog2: the quantized-page online / staged kernels and the fp16 streamed kernel rescale their
# accumulators only when a step's max passes the kept one by 2^8). The attention GPU tests on the new library,
# then the attention alone at 32k (attention_sweep, the route's own split) and the 8B decode at 32k and the verify
# costs, new library (L) against session 38's (E, .dev/lib_eager.so.gz), interleaved.
export EXL2_CARRIED_LIBRARY=1
source scripts/device/common.sh
begin_call bf2
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
gpu_tests_verbose tests 220 -n 12 tests/kernels/test_kv_quant_kernels.py tests/kernels/test_paged_attention.py \
  tests/kernels/test_paged_attention_stream.py tests/unit/test_attention_planning.py $GEMV_GPU_TESTS \
  tests/kernels/test_gemv_repeat_identical.py
echo "tests $(( $(date +%s) - T0 )) s"
use_libraries E=.dev/lib_eager.so.gz
cp /tmp/libD.so /tmp/libL.so
sweep() {  # sweep NAME: the loaded library's attention at 32k
  timeout 60 python3 scripts/attention_sweep.py --context 32768 --types fp16,q8,q4 --splits 0 \
    --json "$R/sweep_$1.json" > "$R/sweep_$1.txt" 2>&1
  echo "== sweep $1"; grep -vE "^\s*$" "$R/sweep_$1.txt" | tail -5 | cut -c1-160
}
for round in 1 2; do
  for v in E L; do
    cp "/tmp/lib$v.so" "$LIB"
    fits 60 "sweep $v$round" && sweep "$v$round"
  done
done
for v in L E; do
  cp "/tmp/lib$v.so" "$LIB"
  fits 90 "bench $v" && bench_8b "32k_$v" 90 32768 fp16,q8,q4
done
for v in E L; do
  cp "/tmp/lib$v.so" "$LIB"
  fits 60 "spec $v" && spec_costs "$v"
done
cp /tmp/libL.so "$LIB"
echo "total $(( $(date +%s) - T0 )) s"
