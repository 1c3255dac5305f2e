#!/usr/bin/env bash
# Device call BF6c (session 40; BF6a/b's warm machine; carry .ggc; ~4 min): the GGUF reassembled, the default
# model built (CPU), then the cuda-marked tests BF5 skipped for want of it (SmolLM2 greedy parity of the GPU path
# against the reference, lookahead, speculation exactness: session 39's 52) on this session's final library, whose
# lazy running max changes the decode attention SmolLM2 runs (fp16 pages over 3 kv heads: the staged kernel).
export EXL2_SKIP_BUILD=1
source scripts/device/common.sh
begin_call bf6
smollm2_gpu_tests
echo "total $(( $(date +%s) - T0 )) s"
