#!/usr/bin/env bash
# RAN in session 50 (H100): the k = 4 verify by role; fused norm at 5 rows 1.612x (gate/up doubles), default 1.246x.
# Device call BN1 (session 50; carry .whl and .dev, csrc faef46bdd949, no build; BN1_LIMIT seconds (300)):
# where a k = 4 verify's fused norm loses, GEMV role by role. At M >= 3 a verify step runs the norm as its own
# launch before q/k/v and gate/up (~0.24 ms at k = 4, BH1: 1.146x a decode step without them against 1.245x);
# the norm inside the GEMV over three passes lost by far more (session 14: 1.678x), never measured by role.
# spec_bench --kernels now labels every GEMV launch with its role and layer:
#  D  = the default (pre-gathering norm launches), F3 = EXL2_BACKEND_FUSED_NORM_PASSES=3 (the norm inside the GEMV
#  up to M = 6), each with the kernel tables, then both again without them (interleaved).
export EXL2_CARRIED_LIBRARY=1
source scripts/device/common.sh
begin_card_call bn1 "${BN1_LIMIT:-300}"
spec_kernels() {
  local name=$1; shift
  env "$@" timeout 110 python3 scripts/spec_bench.py --skip smollm2 --iters 30 --kernels --work-dir /tmp/spec_bench \
    --out "$R/spec_$name.json" 2> "$R/spec_$name.log"
  echo "== spec $name: $(grep -o 'decode [0-9.]* ms, verify ratio.*' "$R/spec_$name.log" | head -1 | cut -c1-120)"
}
spec_kernels Dk
fits 110 F3k "$L" && spec_kernels F3k EXL2_BACKEND_FUSED_NORM_PASSES=3
fits 60 D2 "$L" && spec_line D2
fits 60 F32 "$L" && spec_line F32 EXL2_BACKEND_FUSED_NORM_PASSES=3
echo "total $(( $(date +%s) - T0 )) s"
