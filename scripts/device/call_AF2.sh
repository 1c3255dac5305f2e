#!/usr/bin/env bash
# Device call AF2 (session 17; carry .whl and .dev/libexl2_kernels.so.gz; ~540 s): a verify step's attention with
# row tiles sharing rings (the staged kernel with up to 3 row tiles of 8 per CTA, csrc/layers/
# paged_attention_quant_mma.cu; cuda_layers.attn_tiles_per_cta), never run, and the split planning that now counts
# the tensor-core kernel's tiles of 8 (it counted the CUDA-core kernel's tiles of 4: six splits for the 8B's k = 4
# verify at 1k, half a wave). AA1: the k = 4 verify's attention held 484 us of the critical path against the
# decode's 222 (three CTAs per split and kv head, each reading the split's K and V).
#  1. the new kernel's GPU tests: every format pair and fp16 pages against the reference, its bit-identity to the
#     one-tile kernels at explicit splits, the library's refusal of bad codes;
#  2. verify costs (spec_bench) with shared tiles (default) and without (EXL2_BACKEND_ATTN_SHARED_TILES=0: the
#     planning fix alone), interleaved twice; AE1 had 1.316 at k = 4 (register kernels, old planning);
#  3. `bench` at 1k and 32k (fp16 / q8 / q4): decode is untouched (one row tile), the closing figures;
#  4. the rest of the attention GPU tests (the planning change reaches every automatic split);
#  5. if time is left: the 70B shape at 1k (issue 3 asks for it; last measured in session 6).
export EXL2_CARRIED_LIBRARY=1
source scripts/device/common.sh
begin_call af2
gpu_tests_verbose tiles 120 -n 12 tests/kernels/test_kv_quant_kernels.py tests/kernels/test_paged_attention.py \
  -k "staged_tiles or bit_identical or bad_kernel"
echo "elapsed $(( $(date +%s) - T0 )) s"
spec_costs tiles1
spec_costs notiles1 EXL2_BACKEND_ATTN_SHARED_TILES=0
spec_costs tiles2
spec_costs notiles2 EXL2_BACKEND_ATTN_SHARED_TILES=0
echo "elapsed $(( $(date +%s) - T0 )) s"
write_70b_background
bench_8b final 120 1024,32768 fp16,q8,q4
echo "elapsed $(( $(date +%s) - T0 )) s"
gpu_tests_verbose attn 200 -n 10 tests/kernels/test_kv_quant_kernels.py tests/kernels/test_paged_attention.py \
  tests/unit/test_attention_planning.py -k "not staged_tiles and not bit_identical and not bad_kernel"
echo "elapsed $(( $(date +%s) - T0 )) s"
if [ "$(left 540)" -gt 150 ]; then
  wait $W70; tail -1 "$R/write_70b.txt"
  timeout "$(left 535)" python3 -m exl2_backend.cli.main bench /tmp/models/llama3-70b --contexts 1024 \
    --cache-type fp16 --json "$R/bench_70b.json" > "$R/bench_70b.txt" 2>&1
  echo "== 70B"; grep -E "^│ +[0-9]+ │" "$R/bench_70b.txt"; tail -2 "$R/bench_70b.txt" | cut -c1-200
else
  kill $W70 2>/dev/null
fi
echo "total $(( $(date +%s) - T0 )) s"
