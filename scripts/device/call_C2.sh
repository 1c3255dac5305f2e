#!/usr/bin/env bash
# Device call C2 (the warm machine of C1; carries .whl, .dev/gguf_part_ab, .dev/gguf_part_ac): SmolLM2 reassembled;
# the default model built by the converter (CPU, in the background); a GPU conversion at 4.0 bpw from the shipped
# measurement, loaded by ExLlamaV2 and compared with ours; speculative acceptance and speed on SmolLM2; the
# SmolLM2 GPU tests; quantized-cache KL on SmolLM2.
export EXL2_SKIP_BUILD=1
source scripts/device/common.sh
mkdir -p /tmp/smol && cp .dev/gguf_part_a* /tmp/smol/ 2>/dev/null
ls /tmp/smol; cat /tmp/smol/gguf_part_a* > /tmp/smol.gguf && export EXL2_BACKEND_DEFAULT_GGUF=/tmp/smol.gguf
export EXL2_BACKEND_CACHE_DIR=/tmp/exl2cache
t=$(date +%s)
python3 -c "from exl2_backend.default_model import ensure_default_fp16 as f; print(f())" 2>&1 | tail -1
(t0=$(date +%s); python3 -c "from exl2_backend.default_model import ensure_default_model as f; print(f())" \
  > "$OUT/default_model_build.txt" 2>&1; echo "default model rc=$? in $(( $(date +%s) - t0 )) s" >> "$OUT/default_model_build.txt") &
BUILD=$!
FP16=/tmp/exl2cache/default/fp16
timeout 90 python3 -m exl2_backend.cli.main convert $FP16 /tmp/smol40 --bpw 4.0 --head-bits 6 --device cuda \
  --measurement exl2_backend/data/smollm2_measurement.json --no-progress > "$OUT/convert_gpu_4.0.txt" 2>&1
tail -2 "$OUT/convert_gpu_4.0.txt"
timeout 150 python3 scripts/device/exllamav2_compare.py --out "$OUT" --compat-only /tmp/smol40 2>&1 | tail -3
echo "convert+exllamav2 $(( $(date +%s) - t )) s"; t=$(date +%s)
timeout 130 python3 scripts/spec_bench.py --skip costs --work-dir /tmp/spec_bench --out "$OUT/spec_smollm2.json" \
  2> "$OUT/spec_smollm2.log"; tail -12 "$OUT/spec_smollm2.log"
echo "spec $(( $(date +%s) - t )) s"; t=$(date +%s)
wait $BUILD; tail -1 "$OUT/default_model_build.txt"
timeout 120 python3 -m pytest tests/engine/test_gpu_parity.py tests/engine/test_lookahead.py tests/spec \
  -q -m cuda -p no:cacheprovider --timeout 100 -rf 2>&1 | tee "$OUT/cuda_tests_c2.txt" | grep -E "FAILED|passed|failed" | tail -10
echo "tests $(( $(date +%s) - t )) s"; t=$(date +%s)
timeout 60 python3 scripts/kvcache_device.py quality --window 1024 --max-tokens 4096 2>&1 | tee "$OUT/kvcache_quality.txt" | tail -8
t=$(date +%s)
timeout 150 python3 -m pytest $CUDA_TESTS_NO_SMOLLM2 -q -m cuda -p no:cacheprovider --timeout 100 -rf 2>&1 | tee "$OUT/cuda_tests_c2b.txt" | grep -E "FAILED|passed|failed|Error" | tail -14
echo "tests b $(( $(date +%s) - t )) s"
