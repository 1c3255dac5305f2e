#!/usr/bin/env bash
# Device call M2 (session 8; the warm machine of M1, carry .whl, .dev/gguf_part_ab, .dev/gguf_part_ac): with the
# GEMV chain on by default,
#  1. the SmolLM2 GPU tests (greedy parity with the reference path, lookahead, speculation);
#  2. the rest of the GPU tests without SmolLM2 (M1 ran the GEMV kernel tests);
#  3. the attention variants end to end at 32k (8B; one bench each): the default (two-pass tensor-core kernel for
#     quantized pages, the CUDA-core kernel for fp16 decode), the one-pass variants 1 and 2 (fp16 decode on the
#     tensor-core kernel too) and the deeper two-pass variant.
export EXL2_SKIP_BUILD=1
source scripts/device/common.sh
results_dir
trap '[ -d "$R" ] && pack_results m2' EXIT
mkdir -p /tmp/smol && cp .dev/gguf_part_a* /tmp/smol/ 2>/dev/null
cat /tmp/smol/gguf_part_a* > /tmp/smol.gguf && export EXL2_BACKEND_DEFAULT_GGUF=/tmp/smol.gguf
export EXL2_BACKEND_CACHE_DIR=/tmp/exl2cache
t=$(date +%s)
python3 -c "from exl2_backend.default_model import ensure_default_model as f; print(f())" > "$R/default_model.txt" 2>&1
tail -1 "$R/default_model.txt"
gpu_tests smollm2 120 tests/engine/test_gpu_parity.py tests/engine/test_lookahead.py tests/spec --timeout 100
echo "smollm2 $(( $(date +%s) - t )) s"; t=$(date +%s)
gpu_tests rest 200 $CUDA_TESTS_NO_SMOLLM2 --timeout 120 --ignore=tests/kernels/test_gemv_chain.py \
  --ignore=tests/kernels/test_gemv_norm.py --ignore=tests/kernels/test_exl2_gemm.py
echo "tests $(( $(date +%s) - t )) s"; t=$(date +%s)
bench32k() {  # name, then environment assignments
  local name=$1; shift
  env "$@" timeout 75 python3 -m exl2_backend.cli.main bench --shape llama3-8b --bpw 4.0 \
    --model-out /tmp/models/llama3-8b --contexts 32768 --cache-type fp16,q8,q4 --json "$R/attn_$name.json" \
    > "$R/attn_$name.txt" 2>&1
  echo "$name:"; grep -A6 "decode tokens/s by cache" "$R/attn_$name.txt" | grep 32768
}
bench32k online2 EXL2_BACKEND_ATTN_MMA_ONLINE=2 EXL2_BACKEND_ATTN_FP16_MMA=1
bench32k online1 EXL2_BACKEND_ATTN_MMA_ONLINE=1 EXL2_BACKEND_ATTN_FP16_MMA=1
bench32k deep EXL2_ATTN_QUANT_MMA_DEEP=1
echo "attention variants $(( $(date +%s) - t )) s"
