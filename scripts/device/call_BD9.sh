#!/usr/bin/env bash
# Device call BD9 (session 37; carry .whl and .dev/libexl2_kernels.so.gz; ~120 s). persistent_bound's model put
# ~6% of the layer GEMVs in 12 FMAs per word of arithmetic (BD2: all parts 1.826 ms, none 1.713); session 14
# (H200) found the real decode and mma worth 25% of one layer's four GEMVs (gemv_probe: 54.37 -> 40.69 us). The
# current library on this card, under its timing probes (results wrong), one process each: none, 1 no activation
# gather, 2 no split-K finish, 4 no decode or mma, 6 neither finish nor arithmetic, then none again.
export EXL2_CARRIED_LIBRARY=1
source scripts/device/common.sh
begin_call bd9
nvidia-smi --query-gpu=name --format=csv,noheader
for probe in 0 1 2 4 6 0; do
  EXL2_GEMV_PROBE=$probe timeout 60 python3 scripts/gemv_probe.py --out "$R/probe${probe}_$SECONDS.json" \
    > "$R/probe${probe}.txt" 2>&1
  echo "== probe $probe"; grep -v '^exl2_backend' "$R/probe${probe}.txt" | tail -7
done
echo "total $(( $(date +%s) - T0 )) s"
