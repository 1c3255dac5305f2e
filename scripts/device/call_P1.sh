#!/usr/bin/env bash
# Device call P1 (prepared in session 9 for the next one; carry .whl and .dev/libexl2_kernels.so.gz). Session 9:
# one 8B layer's GEMVs take ~70 us in the decode graph where a bulk-copy streamer moves the same launch sizes in
# ~36 us (stream_bench). Where the ~9 us per GEMV go, in the decode graph itself:
#  0. first, verify costs (4. below);
#  1. the 8B decode step with each GEMV stage skipped in turn (EXL2_GEMV_PROBE: 1 no gather, 2 no split-K ticket /
#     reduce, 4 no decode / mma; outputs wrong, timings valid; profile_decode's greedy check will say so);
#  2. ncu of the gate/up and down GEMVs with warm caches (--cache-control none; session 9's N4 flushed them);
#  3. bench_gemm --m1 (each 8B shape alone, back to back) for the kernel-level figures beside stream_bench's;
#  4. verify costs (spec_bench) with the norm fused up to 3 passes (EXL2_BACKEND_FUSED_NORM_PASSES=3: the k = 2 / 4
#     verify's M = 3 / 5 rows fused instead of add_rms_norm + pregather launches; one pass now waits one round
#     trip, it waited 8-12 when call I1 made one pass the rule). If it wins, make 3 the default.
export EXL2_CARRIED_LIBRARY=1
source scripts/device/common.sh
results_dir
trap '[ -d "$R" ] && pack_results p1' EXIT
t=$(date +%s)
for passes in 1 3; do spec_costs "passes$passes" EXL2_BACKEND_FUSED_NORM_PASSES=$passes; done
echo "spec $(( $(date +%s) - t )) s"
t=$(date +%s)
for probe in 0 1 2 4 7; do
  decode_step_1k "probe$probe" nochain EXL2_GEMV_PROBE=$probe
  grep -A3 "critical path" "$R/prof_probe$probe.txt" | grep gemv_tma | head -1
done
echo "probes $(( $(date +%s) - t )) s"; t=$(date +%s)
# chain_once launches, per repetition: o, gate/up, down, q/k/v (then the chain, not matched)
ncu_chain_once gateup_warm gemv_tma_kernel 13 --cache-control none
ncu_chain_once down_warm gemv_tma_kernel 14 --cache-control none
echo "ncu $(( $(date +%s) - t )) s"; t=$(date +%s)
timeout 60 python3 scripts/bench_gemm.py --m1 2>&1 | tee "$R/bench_gemm_m1.txt" | grep -E "M1|us" | tail -8
echo "bench_gemm $(( $(date +%s) - t )) s"
