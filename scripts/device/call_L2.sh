#!/usr/bin/env bash
# Device call L2 (prepared in session 7; the warm machine of L1, carry .whl, .dev/gguf_part_ab, .dev/gguf_part_ac):
# SmolLM2 reassembled, the default model built; the SmolLM2 GPU tests (parity, lookahead, speculation); the
# quantized-cache quality (KL against the fp16-cache run) with the tensor-core attention kernel, the default since
# session 7, and with the CUDA-core kernel it replaced.
export EXL2_SKIP_BUILD=1
source scripts/device/common.sh
results_dir
trap '[ -d "$R" ] && pack_results l2' EXIT
mkdir -p /tmp/smol && cp .dev/gguf_part_a* /tmp/smol/ 2>/dev/null
ls /tmp/smol; cat /tmp/smol/gguf_part_a* > /tmp/smol.gguf && export EXL2_BACKEND_DEFAULT_GGUF=/tmp/smol.gguf
export EXL2_BACKEND_CACHE_DIR=/tmp/exl2cache
t=$(date +%s)
python3 -c "from exl2_backend.default_model import ensure_default_model as f; print(f())" > "$R/default_model.txt" 2>&1
tail -1 "$R/default_model.txt"
echo "default model $(( $(date +%s) - t )) s"; t=$(date +%s)
gpu_tests smollm2 150 tests/engine/test_gpu_parity.py tests/engine/test_lookahead.py tests/spec --timeout 100
echo "tests $(( $(date +%s) - t )) s"; t=$(date +%s)
for mma in 1 0; do
  EXL2_BACKEND_ATTN_QUANT_MMA=$mma timeout 70 python3 scripts/kvcache_device.py quality --window 1024 \
    --max-tokens 4096 --out "$R/q$mma" > "$R/quality_mma$mma.txt" 2>&1
  echo "tensor-core kernel=$mma:"; tail -6 "$R/quality_mma$mma.txt"
done
echo "quality $(( $(date +%s) - t )) s"
