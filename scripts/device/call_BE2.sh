#!/usr/bin/env bash
# Device call BE2 (session 39; BE1's warm machine; carry .ggb, the GGUF's second part; seconds): kept in /tmp/smol
# for BE3, which must follow within 30 s.
# (It ran with a plain copy of its GGUF part; common.sh's keep_gguf_parts does that since.)
export EXL2_SKIP_BUILD=1  # (the library BE1 unpacked stays)
source scripts/device/common.sh; keep_gguf_parts; ls -la /tmp/smol && ls /tmp/torch_extensions 2>&1 | head -3
