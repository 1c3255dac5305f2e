#!/usr/bin/env bash
# Device call BE3 (session 39; BE1/BE2's warm machine; carry .ggc, the GGUF's last part and its hash; ~9 min).
# Session 38 fixed a GEMV race (wrong warp tiles now and then); the figures measured through the GPU path before
# it are re-measured here on the fixed library: the SmolLM2 GGUF reassembled, the default model built (CPU, in the
# background); a GPU conversion at 4.0 bpw loaded by ExLlamaV2 and compared with ours (logit agreement);
# speculative acceptance and speed on SmolLM2 (draft model and n-gram); every cuda-marked test outside BE1's suites
# (the SmolLM2 parity, lookahead and speculation tests among them); quantized-cache KL and the default model's
# quality against FP16 (`eval`, GPU). It ran with the reassembly and the model steps inline; they are the helpers
# keep_gguf_parts and smollm2_models (common.sh) since.
export EXL2_CARRIED_LIBRARY=1
source scripts/device/common.sh
begin_call be3
keep_gguf_parts || { echo "GGUF parts missing or wrong"; ls -la /tmp/smol; exit 1; }
nvidia-smi --query-gpu=name --format=csv,noheader
smollm2_models
FP16=/tmp/exl2cache/default/fp16
timeout 100 python3 scripts/device/exllamav2_compare.py --out "$R" --compat-only /tmp/smol40 > "$R/compat_smol40.txt" 2>&1
tail -4 "$R/compat_smol40.txt" | cut -c1-400
echo "convert+exllamav2 $(( $(date +%s) - T0 )) s"
timeout 130 python3 scripts/spec_bench.py --skip costs --work-dir /tmp/spec_bench --out "$R/spec_smollm2.json" \
  2> "$R/spec_smollm2.log"; tail -14 "$R/spec_smollm2.log"
echo "spec $(( $(date +%s) - T0 )) s"
wait $BUILD; tail -1 "$R/default_model_build.txt"
fits 170 "smollm2 gpu tests" && gpu_tests_verbose cuda_rest 170 -n 4 tests/engine tests/spec tests/serve tests/unit \
  --ignore=tests/unit/test_convert_device.py --ignore=tests/engine/test_prefill_memory.py \
  --ignore=tests/serve/test_batch_invariance.py
echo "tests $(( $(date +%s) - T0 )) s"
fits 60 "kv quality" && { timeout 60 python3 scripts/kvcache_device.py quality --window 1024 --max-tokens 4096 \
  --out "$R" > "$R/kvcache_quality.txt" 2>&1; tail -8 "$R/kvcache_quality.txt"; }
EXL2=/tmp/exl2cache/default/exl2
fits 40 "eval" && { timeout 40 python3 -m exl2_backend.cli.main eval $EXL2 --reference $FP16 --device cuda --json \
  > "$R/eval_default.json" 2> "$R/eval_default.err"; cat "$R/eval_default.json" | head -c 600; echo; }
echo "total $(( $(date +%s) - T0 )) s"
