#!/usr/bin/env bash
# PREPARED in session 51, not run (the session's device time went to starts that found no machine).
# Device call BO2 (session 51; carry .whl and .dev: this csrc's library; BO2_LIMIT seconds (450)): after BO1, the
# library with the fused norm's inverse row map under the whole GPU suite that needs no SmolLM2 (every model,
# engine, graph and serving test on the GPU beside the kernels), then the closing figures: `bench` of the 8B at 1k
# and 32k (fp16 / q8 / q4 caches) and spec_bench's step costs; ExLlamaV2 beside ours if time is left (H200 only).
export EXL2_CARRIED_LIBRARY=1
source scripts/device/common.sh
begin_card_call bo2 "${BO2_LIMIT:-450}"
whole_gpu_suite "$L"
final_figures "$L"
echo "total $(( $(date +%s) - T0 )) s"
