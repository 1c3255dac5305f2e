#!/usr/bin/env bash
# Device call BF6b (session 40; BF6a's warm machine; carry .ggb; seconds): the GGUF's second part into /tmp/smol.
export EXL2_SKIP_BUILD=1  # (the library BF6a unpacked stays)
source scripts/device/common.sh; keep_gguf_parts; ls -la /tmp/smol
