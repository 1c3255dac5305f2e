#!/usr/bin/env bash
# Ran in session 45 (BL1_LIMIT=500, H100 80GB HBM3, 414 s) on 59ecd36's library with f81f4e2's attention change
# applied; the A / O comparisons failed (ABI 13 libraries under the ABI 14 package: reference ops). Results:
# docs/performance.md, session 45. The cluster norm it measured is gone (874dfaa).
# Device call BL1 (session 45; carry .whl and .dev; BL1_LIMIT seconds (560), steps in order as time allows).
# Libraries: D (.dev/libexl2_kernels.so.gz, this tree: the cluster-shared fused norm, off unless
# EXL2_BACKEND_NORM_CLUSTER is set, and the staged attention copying its ring's first steps before the PDL wait),
# A (.dev/lib_a.so.gz, 1d3265a: the default at the start of the session), O (.dev/lib_old.so.gz, 453bdb4).
#  1. the cluster norm's GPU tests (bit-identity with add_rms_norm + GEMV) and the fused-norm / rope suites;
#  2. verify / decode step costs: D default against D with the cluster norm (EXL2_BACKEND_NORM_CLUSTER=4, then 2 and
#     8), interleaved, then A (the smem layout change of every GEMV: two more mbarriers, a larger norm sum area);
#  3. the GEMV suites (every kernel's layout moved by 16 + 224 bytes);
#  4. attention outputs bit for bit, O against D (scripts/device/attn_bits.py), staged kernels; the attention / KV GPU
#     tests; the engine GPU tests written in session 44 and never run on a GPU;
#  5. the 32k attention alone, q4 / q8, A D A D; the verify graph's kernels with the cluster norm; `bench` 32k q8 / q4.
export EXL2_CARRIED_LIBRARY=1
source scripts/device/common.sh
begin_call bl1
L=${BL1_LIMIT:-560}
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
use_libraries O=.dev/lib_old.so.gz A=.dev/lib_a.so.gz
gpu_tests_verbose norm_cluster 80 -n 8 tests/kernels/test_gemv_norm_cluster.py tests/kernels/test_gemv_norm.py \
  tests/kernels/test_gemv_rope_kv.py
echo "elapsed $(( $(date +%s) - T0 )) s"
for v in "D1" "C4a EXL2_BACKEND_NORM_CLUSTER=4" "C2a EXL2_BACKEND_NORM_CLUSTER=2" "D2" "C4b EXL2_BACKEND_NORM_CLUSTER=4" \
         "C8a EXL2_BACKEND_NORM_CLUSTER=8"; do
  fits 40 "spec $v" "$L" && spec_line $v
done
each_library "$L" 40 "A" spec_line
echo "elapsed $(( $(date +%s) - T0 )) s"
fits 70 "gemv suites" "$L" && gpu_tests gemv_suites 60 -n 12 $GEMV_GPU_TESTS -k "not llama3_8b"
fits 60 "bits" "$L" && attn_bits_against_old auto
fits 100 "attention tests" "$L" && gpu_tests attention 90 -n 8 tests/kernels/test_paged_attention.py \
  tests/kernels/test_paged_attention_stream.py tests/kernels/test_kv_quant_kernels.py tests/kernels/test_prefill_attention.py
fits 60 "engine tests" "$L" && gpu_tests_verbose engine 60 -n 4 tests/engine/test_staged_attention_engine.py \
  tests/engine/test_stream_attention_engine.py tests/engine/test_cache_types.py tests/serve/test_batch_invariance.py
echo "elapsed $(( $(date +%s) - T0 )) s"
each_library "$L" 40 "A D A D" attention_sweep_32k q4,q8 3
fits 70 "verify kernels" "$L" && { EXL2_BACKEND_NORM_CLUSTER=4 timeout 70 python3 scripts/spec_bench.py --skip smollm2,engine \
  --iters 20 --kernels --work-dir /tmp/spec_bench --out "$R/spec_kernels.json" > "$R/spec_kernels.txt" 2>&1; \
  grep -iE "critical|norm|gemv|attn|attention|step" "$R/spec_kernels.txt" | head -40 | cut -c1-160; }
each_library "$L" 110 "D A" bench_8b 110 32768 q8,q4
echo "total $(( $(date +%s) - T0 )) s"
