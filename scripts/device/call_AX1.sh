#!/usr/bin/env bash
# Device call AX1 (session 33; carry .whl and .dev/libexl2_kernels.so.gz, C ABI 13; ~560 s).
#  1. The streamed attention on tensor cores (csrc/layers/paged_attention_stream_mma.cu: fp16 pages over 8 kv heads,
#     ldmatrix + mma from a ring of padded 2 KB token rows) never ran: its GPU tests and the streamed kernel's others.
#  2. Where they pass: the decode attention at 1k / 8k / 32k (8B shape) and 32k (70B's 64 query heads), the default
#     route against EXL2_BACKEND_ATTN_STREAM_FP16=1; then `bench` 1k / 32k fp16 both ways (interleaved).
#  3. Session 32's AW5 (commit 4123316, cherry-picked): the sampler's GPU tests and filter_cost --profile (the
#     near-uniform top-p row: 594.6 us against 141.4 for torch on the H100 in AW4), sampled_bench if time is left.
export EXL2_CARRIED_LIBRARY=1
source scripts/device/common.sh
begin_call ax1
nvidia-smi --query-gpu=name --format=csv,noheader
L=${AX1_LIMIT:-565}
F=EXL2_BACKEND_ATTN_STREAM_FP16=1
gpu_tests_verbose stream 90 -n 12 tests/kernels/test_paged_attention_stream.py tests/kernels/test_paged_attention.py \
  tests/kernels/test_kv_quant_kernels.py -k "stream or Stream or streamed or tensor_core or bad_kernel_codes"
echo "elapsed $(( $(date +%s) - T0 )) s"
sweep() {  # sweep NAME CONTEXT HQ SPLITS [ENV=VALUE...]
  local name=$1 ctx=$2 hq=$3 splits=$4; shift 4
  env "$@" timeout 40 python3 scripts/attention_sweep.py --context "$ctx" --hq "$hq" --types fp16 --splits "$splits" \
    --json "$R/sweep_$name.json" > "$R/sweep_$name.txt" 2>&1
  echo "-- $name: $(grep -hE "splits|Error" "$R/sweep_$name.txt" | tr '\n' ' ' | cut -c1-200)"
}
if ! grep -qE "FAILED|ERROR" "$R/stream.txt"; then
  for ctx in 1024 8192 32768; do
    fits 40 "sweep $ctx" "$L" && sweep "d$ctx" "$ctx" 32 0
    fits 40 "sweep $ctx" "$L" && sweep "f$ctx" "$ctx" 32 0 $F
  done
  fits 40 "sweep 70B" "$L" && sweep d70 32768 64 0
  fits 40 "sweep 70B" "$L" && sweep f70 32768 64 0 $F
  fits 40 "sweep 66" "$L" && sweep f32k_66 32768 32 66 $F
  fits 80 "bench D1" "$L" && bench_8b D1 80 1024,32768 fp16
  fits 60 "bench F1" "$L" && bench_8b F1 60 1024,32768 fp16 $F
  fits 60 "bench D2" "$L" && bench_8b D2 60 1024,32768 fp16
  fits 60 "bench F2" "$L" && bench_8b F2 60 1024,32768 fp16 $F
fi
echo "elapsed $(( $(date +%s) - T0 )) s"
fits 130 "sampler tests" "$L" && gpu_tests_verbose sampling 130 -n 3 --dist loadfile --timeout 120 \
  tests/kernels/test_sampling_kernel.py tests/engine/test_sampled_lookahead_tiny.py \
  tests/engine/test_sampled_gpu_tiny.py tests/unit/test_filtered_probs_skip.py
fits 40 "filter_cost" "$L" && { timeout 40 python3 scripts/filter_cost.py 128256 --profile > "$R/filter_cost.txt" 2>&1
  grep -E "^sample_tokens|GPU time per call" "$R/filter_cost.txt" | tail -24; }
fits 60 "sampled bench" "$L" && [ -d /tmp/models/llama3-8b ] && { timeout 60 python3 scripts/sampled_bench.py \
  /tmp/models/llama3-8b --tokens 128 --json "$R/sampled_bench.json" > "$R/sampled_bench.txt" 2>&1
  echo "== sampled bench, kernel"; tail -13 "$R/sampled_bench.txt"; }
echo "total $(( $(date +%s) - T0 )) s"
