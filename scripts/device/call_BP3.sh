#!/usr/bin/env bash
# Device call BP3 (session 52; carry .whl and .dev: this csrc's library, session 48's faef46bdd949; BP3_LIMIT seconds
# (200)): the tree as it lands after the stored-order norm's removal, under the whole GPU suite that needs no SmolLM2.
export EXL2_CARRIED_LIBRARY=1
source scripts/device/common.sh
begin_card_call bp3 "${BP3_LIMIT:-200}"
whole_gpu_suite "$L"
echo "total $(( $(date +%s) - T0 )) s"
