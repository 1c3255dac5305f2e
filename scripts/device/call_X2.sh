#!/usr/bin/env bash
# Device call X2 (session 14; carry .whl, .dev/libexl2_kernels.so.gz and .dev/libexl2_kernels_onerun.so.gz):
#  1. the 8B decode step at 1k: the new default (the one-run straight path as the code, no macro) / X1's one-run
#     build / the new default;
#  2. verify costs with the fused norm over up to three passes (EXL2_BACKEND_FUSED_NORM_PASSES=3: M <= 6 without
#     the pre-gathering norm launch) against the default (one pass, then norm_pregather);
#  3. one 8B layer's GEMVs under the timing probes (scripts/gemv_probe.py: none / no decode or mma / no split-K
#     reduction), for the 4-bit and the mixed 3/4-bit MLP layer; ncu of layer 0's gate/up;
#  4. the GEMV GPU tests with the new default, to the end of the call.
export EXL2_CARRIED_LIBRARY=1
source scripts/device/common.sh
begin_call x2
cp "$LIB" /tmp/libN.so && gunzip -c .dev/libexl2_kernels_onerun.so.gz > /tmp/libO.so
interleaved_steps N1 O1 N2
cp /tmp/libN.so "$LIB"
echo "elapsed $(( $(date +%s) - T0 )) s"
spec_costs default
spec_costs passes3 EXL2_BACKEND_FUSED_NORM_PASSES=3
echo "elapsed $(( $(date +%s) - T0 )) s"
for pr in 0 4 2; do
  EXL2_GEMV_PROBE=$pr timeout 60 python3 scripts/gemv_probe.py --out "$R/probe$pr.json" > "$R/probe$pr.txt" 2>&1
  echo "== probe $pr: $(tail -1 "$R/probe$pr.txt" | cut -c1-400)"
done
echo "elapsed $(( $(date +%s) - T0 )) s"
timeout 100 ncu --clock-control none --set full --import-source no -k regex:gemv_tma --launch-skip 5 --launch-count 1 \
  -o "$R/gu" python3 scripts/gemv_probe.py --ncu > "$R/gu.log" 2>&1
ncu --import "$R/gu.ncu-rep" --page details > "$R/gu.details.txt" 2>&1
ncu --import "$R/gu.ncu-rep" --page source --csv --print-source sass 2>&1 | gzip -c > "$R/gu.sass.csv.gz"
rm -f "$R/gu.ncu-rep"
grep -E "layer 0" "$R/gu.log"
grep -E "^    (Duration|DRAM Throughput|Memory Throughput|Compute \(SM\) Throughput|Issue Slots Busy|Executed Ipc Active|Registers Per Thread|Achieved Occupancy)" "$R/gu.details.txt" | head -12
echo "elapsed $(( $(date +%s) - T0 )) s"
gpu_tests_verbose kern "$(left 585)" -n 14 $GEMV_GPU_TESTS -k "not llama3_8b"
echo "total $(( $(date +%s) - T0 )) s"
