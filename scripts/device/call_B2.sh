#!/usr/bin/env bash
# Device call B2 (warm machine of B1, remaining GGUF parts): SmolLM2 reassembled; the converter's bitrate table;
# ExLlamaV2 loading the converted 4.0 bpw model; speculative acceptance on SmolLM2; the SmolLM2 GPU tests;
# quantized-cache KL on SmolLM2.
source scripts/device/common.sh
mkdir -p /tmp/smol && cp .dev/gguf_part_a* /tmp/smol/ 2>/dev/null
ls /tmp/smol
cat /tmp/smol/gguf_part_a* > /tmp/smol.gguf && export EXL2_BACKEND_DEFAULT_GGUF=/tmp/smol.gguf
export EXL2_BACKEND_CACHE_DIR=/tmp/exl2cache
timeout 260 python3 scripts/convert_table.py --out "$OUT" --work /tmp/convert_table --max-tokens 8192 \
  > "$OUT/convert_table.log" 2>&1; tail -22 "$OUT/convert_table.log"
timeout 60 python3 - <<'PY' 2>&1 | tail -4
import json, os, sys, torch
sys.path.insert(0, "scripts/device")
torch.backends.cuda.enable_cudnn_sdp(False)
from pathlib import Path
from exllamav2_compare import compat
from exl2_backend.quant.evaluate import tokenize_eval_text
d = Path("/tmp/convert_table/opt_4.0")
ids, bos = tokenize_eval_text(d, max_tokens=511)
r = compat(d, ([bos] if bos is not None else []) + ids)
Path(os.environ["OUT"], "exllamav2_smollm2.json").write_text(json.dumps(r, indent=1, default=str))
print("exllamav2 on converted SmolLM2 4.0 bpw:", json.dumps(r, default=str)[:600])
PY
timeout 120 python3 scripts/spec_bench.py --skip costs --out "$OUT/spec_smollm2.json" 2> "$OUT/spec_smollm2.log"; tail -10 "$OUT/spec_smollm2.log"
timeout 110 python3 -m pytest tests/engine/test_gpu_parity.py tests/engine/test_lookahead.py tests/serve/test_batch_invariance.py \
  tests/spec -q -m cuda -p no:cacheprovider --timeout 100 -rf 2>&1 | tee "$OUT/cuda_tests_b2.txt" | grep -E "FAILED|passed|failed" | tail -10
timeout 60 python3 scripts/kvcache_device.py quality --window 1024 --max-tokens 4096 2>&1 | tee "$OUT/kvcache_quality.txt" | tail -8
