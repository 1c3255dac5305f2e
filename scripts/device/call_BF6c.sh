#!/usr/bin/env bash
# Device call BF6c (session 40; BF6a/b's warm machine; carry .ggc; ~4 min): the GGUF reassembled, the default
# model built (CPU), then the cuda-marked tests BF5 skipped for want of it (SmolLM2 greedy parity of the GPU path
# against the reference, lookahead, speculation exactness: session 39's 52) on this session's final library, whose
# lazy running max changes the decode attention SmolLM2 runs (fp16 pages over 3 kv heads: the staged kernel).
export EXL2_SKIP_BUILD=1
source scripts/device/common.sh
begin_call bf6
keep_gguf_parts || { echo "GGUF parts missing or wrong"; ls -la /tmp/smol; exit 1; }
nvidia-smi --query-gpu=name --format=csv,noheader
python3 -c "from exl2_backend.default_model import ensure_default_model as f; print(f())" \
  > "$R/default_model_build.txt" 2>&1; echo "default model rc=$? in $(( $(date +%s) - T0 )) s"
gpu_tests_verbose cuda_rest 170 -n 4 tests/engine tests/spec tests/serve tests/unit \
  --ignore=tests/unit/test_convert_device.py --ignore=tests/engine/test_prefill_memory.py \
  --ignore=tests/serve/test_batch_invariance.py
echo "total $(( $(date +%s) - T0 )) s"
