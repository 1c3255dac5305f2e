#!/usr/bin/env bash
# RAN in session 52 (H100 80GB HBM3, 103 s): 2,337 passed, 17 skipped (91 s, 8 workers).
# Device call BP3 (session 52; carry .whl and .dev: this csrc's library, session 48's faef46bdd949; BP3_LIMIT seconds
# (200)): the tree as it lands after the stored-order norm's removal, under the whole GPU suite that needs no SmolLM2.
export EXL2_CARRIED_LIBRARY=1
source scripts/device/common.sh
begin_card_call bp3 "${BP3_LIMIT:-200}"
whole_gpu_suite "$L"
echo "total $(( $(date +%s) - T0 )) s"
