#!/usr/bin/env bash
# Device call BE2 (session 39; BE1's warm machine; carry .ggb, the GGUF's second part; seconds): kept in /tmp/smol
# for BE3, which must follow within 30 s.
mkdir -p /tmp/smol && cp .ggb/part_* /tmp/smol/ && ls -la /tmp/smol && ls /tmp/torch_extensions 2>&1 | head -3
