#!/usr/bin/env bash
# Device call AW5 (session 32; carry .whl and .dev/libexl2_kernels.so.gz, C ABI 13; ~120 s): after AW4 (H100: 110
# tests passed; GPU time per sampled token 0.37-0.80x the torch path's, but 594.6 against 141.4 us for a
# near-uniform row, whose crowded boundary bin one CTA narrowed with an exp per token per pass and a 32-shuffle
# group sum): each chunk now stores its tokens' (w, race) beside its sorted keys, and the narrowing sums digits as
# segments of the sorted runs. The same checks as AW4.
export EXL2_CARRIED_LIBRARY=1
source scripts/device/common.sh
begin_call aw5
nvidia-smi --query-gpu=name --format=csv,noheader
sampler_checks --profile
echo "total $(( $(date +%s) - T0 )) s"
