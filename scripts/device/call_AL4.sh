#!/usr/bin/env bash
# Device call AL4 (session 23; ~120 s of commands). Carry .whl and .dev/libexl2_kernels.so.gz built from the
# commit that runs. EXL2_SMEM_CARVEOUT=100 (common/pdl.cuh smem_carveout): every launch_kernel launch asks for
# the whole unified L1 / shared storage as shared memory, so that the decode step's kernels (the GEMVs' rings,
# the attention, its reduce, the norms) all run under one carveout; under the driver's per-kernel choice a PDL
# dependent's blocks may wait for an SM to drain before its carveout can change. AL3's tickets, which raised the
# attention kernel's shared memory from 16 to 33-46 KB, took the 1k decode step from 2.253 to 2.571 ms.
# spec_bench default (D) against the carveout (K), interleaved twice.
export EXL2_CARRIED_LIBRARY=1
source scripts/device/common.sh
begin_call al4
interleaved_spec_costs D K=EXL2_SMEM_CARVEOUT=100
echo "total $(( $(date +%s) - T0 )) s"
