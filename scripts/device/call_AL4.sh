#!/usr/bin/env bash
# Device call AL4 (session 23; ~170 s of commands). Carry .whl and .dev/libexl2_kernels.so.gz built from the
# commit that runs. EXL2_SMEM_CARVEOUT=100 (common/pdl.cuh smem_carveout): every launch_kernel launch asks for
# the whole unified L1 / shared storage as shared memory, so that the decode step's kernels (the GEMVs' rings,
# the attention, its reduce, the norms) all run under one carveout; under the driver's per-kernel choice a PDL
# dependent's blocks may wait for an SM to drain before its carveout can change. AL3's tickets, which raised the
# attention kernel's shared memory from 16 to 33-46 KB, took the 1k decode step from 2.253 to 2.571 ms.
# spec_bench default (D) against the carveout (K), interleaved twice. Then a third round of AL2's prefill comparison
# (EXL2_BACKEND_DIRECT_OPS off / on; AL2's two rounds: fp16 68.4 / 59.2 against 60.8 / 57.9 ms, q4 70.9 / 68.5
# against 79.0 / 63.3).
export EXL2_CARRIED_LIBRARY=1
source scripts/device/common.sh
begin_call al4
interleaved_spec_costs D K=EXL2_SMEM_CARVEOUT=100
for v in D X; do
  env $([ $v = X ] && echo EXL2_BACKEND_DIRECT_OPS=1) timeout 90 python3 scripts/profile_prefill.py \
    --shape llama3-8b --workdir /tmp/models --cache-types fp16,q4 --top 8 --json "$R/prefill_$v.json" \
    > "$R/prefill_$v.txt" 2>&1
  echo "-- $v"; grep -E "^== " "$R/prefill_$v.txt" | cut -c1-160
done
echo "total $(( $(date +%s) - T0 )) s"
