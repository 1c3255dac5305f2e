#!/usr/bin/env bash
# Device call BF4 (session 40; right after BF3 on the warm machine; carry .whl and .dev; ~575 s): session 35's
# closing-figures call (call_BA1.sh) on this session's library (the lazy running max, the norm's xmap entries
# before its wait): the streamed-attention routing tests, bench 1k / 32k (fp16 / q8 / q4), verify costs,
# ExLlamaV2 0.3.2 beside ours at 32k (fp16, q4) and at 1k, the GEMV benchmarks at M = 1 and 5.
exec bash scripts/device/call_BA1.sh
