#!/usr/bin/env bash
# Device call BF6a (session 40; carry .whl, .dev, .gga; seconds): the SmolLM2 GGUF's first part kept in /tmp/smol
# (scripts/device/split_default_gguf.sh); BF6b and BF6c must follow within 30 s each.
export EXL2_CARRIED_LIBRARY=1
source scripts/device/common.sh
keep_gguf_parts; ls -la /tmp/smol; nvidia-smi --query-gpu=name --format=csv,noheader
