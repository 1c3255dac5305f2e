#!/usr/bin/env bash
# Device call AG3 (session 18; carry .whl and .dev/libexl2_kernels.so.gz; ~120 s): the reverted library (session 17's
# source, C ABI 9). AG1 / AG2 measured the decode step at 2.36-2.46 ms with the split-norm library, 2.38 with the
# split off, against 2.294-2.301 in session 17's calls: is the difference the code or the machine?
export EXL2_CARRIED_LIBRARY=1
source scripts/device/common.sh
begin_call ag3
spec_costs revert1
timeout 60 python3 scripts/spec_bench.py --skip smollm2 --iters 30 --kernels --work-dir /tmp/spec_bench \
  --out "$R/spec_kernels.json" > "$R/spec_kernels.txt" 2>&1
echo "== spec kernels: $(grep 'step costs' "$R/spec_kernels.txt" | tail -1 | cut -c1-200)"
python3 -c "
import json
c = json.load(open('$R/spec_kernels.json'))['costs_8b']['critical']
for g in ('decode', 'verify_k4'):
    print(g, '  '.join(f'{k[:28]} {v[0]:.0f}x {v[1]:.0f}' for k, v in sorted(c[g].items(), key=lambda kv: -kv[1][1])))
" 2>&1 | cut -c1-400
spec_costs revert2
echo "total $(( $(date +%s) - T0 )) s"
