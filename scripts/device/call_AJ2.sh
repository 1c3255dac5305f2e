#!/usr/bin/env bash
# Device call AJ2 (session 21; carry .whl and .dev: libexl2_kernels.so.gz and libexl2_kernels_timeline.so.gz, both
# with narrowed column blocks; ~560 s). AJ1's timeline: the 8B's gate/up ran 224 blocks on 264 slots, 102 SMs
# streaming two (15.6 us median) beside 20 with one and 10 with none; its slowest block 18.7 us.
#  1. The bit-identity test of narrowed column blocks (EXL2_GEMV_NARROW=0 / 1 in subprocesses).
#  2. Decode / verify steps, narrowed (N, the default) against 8 warp tiles everywhere (W, EXL2_GEMV_NARROW=0),
#     spec_bench interleaved twice; then the ring at 24 and 48 KB (EXL2_GEMV_RING_KB; default 32), one run each.
#  3. The decode step's GEMV timeline with and without narrowing.
#  4. `bench` of the 8B at 1k and 32k with fp16, q8 and q4 caches.
#  5. The GEMV GPU tests and the batch-invariance tests, in what time is left.
export EXL2_CARRIED_LIBRARY=1
source scripts/device/common.sh
begin_call aj2
use_libraries T=.dev/libexl2_kernels_timeline.so.gz
gpu_tests narrow 120 tests/kernels/test_exl2_gemm.py -k narrowed
for round in 1 2; do
  spec_costs N$round
  spec_costs W$round EXL2_GEMV_NARROW=0
done
spec_costs R24 EXL2_GEMV_RING_KB=24
spec_costs R48 EXL2_GEMV_RING_KB=48
cp /tmp/libT.so "$LIB"
timeout 80 python3 scripts/gemv_timeline.py --workdir /tmp/models --json "$R/timeline_N.json" > "$R/timeline_N.txt" 2>&1
EXL2_GEMV_NARROW=0 timeout 80 python3 scripts/gemv_timeline.py --workdir /tmp/models --json "$R/timeline_W.json" \
  > "$R/timeline_W.txt" 2>&1
cp /tmp/libD.so "$LIB"
for v in N W; do echo "-- timeline $v"; tail -8 "$R/timeline_$v.txt"; done
echo "elapsed $(( $(date +%s) - T0 )) s"
bench_8b final 130 1024,32768 fp16,q8,q4
echo "elapsed $(( $(date +%s) - T0 )) s"
gpu_tests_verbose gemv "$(left 570)" -n 12 $GEMV_GPU_TESTS tests/serve/test_batch_invariance.py -k "not llama3_8b"
echo "total $(( $(date +%s) - T0 )) s"
