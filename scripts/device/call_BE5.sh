#!/usr/bin/env bash
# Device call BE5 (session 39; fresh machine; carry .whl and .dev; ~575 s): session 35's closing-figures call
# (call_BA1.sh) again, on the library with session 38's proxy fence (csrc/ 27418b5b...): the streamed-attention
# routing tests, bench 1k / 32k (fp16 / q8 / q4), verify costs, ExLlamaV2 0.3.2 beside ours at 32k (fp16, q4) and at
# 1k, the GEMV benchmarks at M = 1 and 5 against the read bandwidth.
exec bash scripts/device/call_BA1.sh
