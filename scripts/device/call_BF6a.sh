#!/usr/bin/env bash
# Device call BF6a (session 40; carry .whl, .dev, .gga; ~2 min): the SmolLM2 GGUF's first part kept in /tmp/smol
# (scripts/device/split_default_gguf.sh; BF6b and BF6c must follow within 30 s each), then call_BF7.sh's
# measurement: a verify step without its pre-gathering norm launches (the ceiling of a producer-side norm).
export EXL2_CARRIED_LIBRARY=1
source scripts/device/common.sh
keep_gguf_parts; ls -la /tmp/smol
begin_call bf6a
nvidia-smi --query-gpu=name --format=csv,noheader
SPEC_SKIP=engine interleaved_spec_costs default skip=EXL2_BACKEND_MEASURE_SKIP_NORM_PREGATHER=1
echo "total $(( $(date +%s) - T0 )) s"
