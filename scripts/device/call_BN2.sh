#!/usr/bin/env bash
# RAN in session 50 (H100), twice: the probes failed (first the norm-fused GEMV refused them, then the NaN guard).
# Since then spec_bench --skip engine leaves the prompt unprefilled (skip_prefill), so the probes can run: ready again.
# Device call BN2 (session 50; carry .whl and .dev, csrc faef46bdd949, no build; BN2_LIMIT seconds (300)): what a
# verify's GEMVs spend past the decode's, role by role, with the kernel's timing probes (results wrong). BN1 found
# the k = 4 verify's extra ~535 us over a decode step in the norm launches (242), down (+4.5 us per launch, 144),
# o (+2.7, 86), the attention (+56) and q/k/v (+1.1, 30). The probes tell the input gather from the split-K finish:
#  D = default, G = EXL2_GEMV_PROBE=1 (no input gather), R = 2 (no split-K ticket or reduction), GR = 3 (neither);
# spec_bench --kernels each (no engine steps: a probe's wrong outputs fail the engine's NaN guard). The norm-fused
# GEMV refuses probes (its first run failed so), so every variant runs with EXL2_BACKEND_NORM_SMEM_BYTES=0: the
# norm as its own launch at every M (the decode step's q/k/v and gate/up then read add_rms_norm's output).
export EXL2_CARRIED_LIBRARY=1
source scripts/device/common.sh
begin_card_call bn2 "${BN2_LIMIT:-300}"
spec_kernels() {
  local name=$1; shift
  env EXL2_BACKEND_NORM_SMEM_BYTES=0 "$@" timeout 100 python3 scripts/spec_bench.py --skip smollm2,engine --iters 30 --kernels \
    --work-dir /tmp/spec_bench --out "$R/spec_$name.json" 2> "$R/spec_$name.log"
  echo "== spec $name: $(grep -o 'decode [0-9.]* ms, verify ratio.*' "$R/spec_$name.log" | head -1 | cut -c1-120)"
}
spec_kernels D
for v in G=1 R=2 GR=3; do
  fits 100 "${v%%=*}" "$L" && spec_kernels "${v%%=*}" EXL2_GEMV_PROBE="${v#*=}"
done
echo "total $(( $(date +%s) - T0 )) s"
