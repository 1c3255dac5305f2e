#!/usr/bin/env bash
# Device call (about 5-6 GPU minutes): issue 4's bitrate table on SmolLM2-135M and an 8B-shape conversion timing.
# Needs the SmolLM2 GGUF: EXL2_BACKEND_DEFAULT_GGUF, or its parts (.dev/gguf_part_a*, carried over two calls as
# call_C1.sh / call_C2.sh do, kept in /tmp/smol). Writes to $OUT:
#   convert_table.{json,md,log}  the table (target/achieved bpw, perplexity, KL, top-1) and its checks
#   smollm2_measurement.json     commit it as exl2_backend/data/smollm2_measurement.json (the default model's)
#   convert_timing_llama3-8b_L4{,_tf32}.json  8B-shape conversion of 4 layers, fp32 and TF32 forwards, extrapolated
# Converted SmolLM2 dirs stay in /tmp/convert_table for scripts/device/exllamav2_compare.py on the same machine.
source scripts/device/common.sh
if [ -z "${EXL2_BACKEND_DEFAULT_GGUF:-}" ]; then
  mkdir -p /tmp/smol && cp .dev/gguf_part_a* /tmp/smol/ 2>/dev/null
  if [ "$(ls /tmp/smol 2>/dev/null | wc -l)" -ge 3 ]; then
    cat /tmp/smol/gguf_part_a* > /tmp/smol.gguf && export EXL2_BACKEND_DEFAULT_GGUF=/tmp/smol.gguf
  fi
fi
export EXL2_BACKEND_CACHE_DIR=${EXL2_BACKEND_CACHE_DIR:-/tmp/exl2cache}
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())"
# the converter's GPU tests first (triton kernels bit-exact with their references, a GPU conversion decoding to
# exactly its intended weights): a failure here would make every figure below meaningless
python3 -m pytest tests/unit/test_convert_device.py tests/unit/test_gptq.py -q -m cuda -p no:cacheprovider 2>&1 \
  | tee "$OUT/convert_cuda_tests.txt" | tail -5
grep -q " failed" "$OUT/convert_cuda_tests.txt" && { echo "converter GPU tests failed; stopping"; exit 1; }
python3 scripts/convert_table.py --out "$OUT" --work /tmp/convert_table 2>&1 | tee "$OUT/convert_table.log" | tail -32
python3 scripts/convert_timing.py --out "$OUT" --shape llama3-8b --layers 4 2>&1 | tail -2
python3 scripts/convert_timing.py --out "$OUT" --shape llama3-8b --layers 4 --tf32 --tag _tf32 2>&1 | tail -1
