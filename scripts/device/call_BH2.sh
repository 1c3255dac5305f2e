#!/usr/bin/env bash
# Device call BH2 (session 41; BH1's warm machine; carry .ggb; seconds): the GGUF's second part into /tmp/smol.
export EXL2_SKIP_BUILD=1  # (the library BH1 unpacked stays)
source scripts/device/common.sh; keep_gguf_parts; ls -la /tmp/smol
