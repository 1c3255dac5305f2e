#!/usr/bin/env bash
# Device call BL6 (session 48; ~2 min): the GPU tests that need SmolLM2 on a warm machine that has the library
# (after BL5). The default model's GGUF does not fit one call's carry, so it travels in three calls:
#   BL6_PART=1 (carry .whl .dev .gga), BL6_PART=2 (carry .ggb), then BL6_PART=3 (carry .ggc): the GGUF reassembled
#   and checked against its hash, the default model built on the CPU (48 s), `smollm2_gpu_tests` (54 passed).
export EXL2_CARRIED_LIBRARY=1
[ "${BL6_PART:-3}" != 1 ] && export EXL2_SKIP_BUILD=1 EXL2_CARRIED_LIBRARY=0
source scripts/device/common.sh
if [ "${BL6_PART:-3}" != 3 ]; then keep_gguf_parts; ls -la /tmp/smol; exit 0; fi
begin_call bl6
smollm2_gpu_tests
echo "total $(( $(date +%s) - T0 )) s"
