#!/usr/bin/env bash
# RAN in session 49 (H100; docs/performance.md, session 49: the mixed gate/up's first span split streams ~5 us longer).
# Device call BM4 (session 49; carry .whl and .dev: libexl2_kernels.so.gz and libexl2_kernels_timeline.so.gz, the
# measurement build `bash scripts/build_variant.sh EXL2_GEMV_TIMELINE .dev/libexl2_kernels_timeline.so.gz`; ~120 s).
# Why the mixed-width gate/up is slow: BM1's critical path gave the 8 layers whose gate/up is mostly 3-bit 28.97 us
# for 54.4 MB against 25.17 us for the 4-bit layers' 63.3 MB. The GEMV timeline (block by block: wait, stage,
# stream, finish) of one 8B decode step at 1k says whether every block of those launches streams slower (the chunk
# loop's rate) or a few blocks set the end (span items re-arming their ring between runs, unequal items). --raw keeps
# the stamps for the per-launch analysis off the device (docs/performance.md, session 49).
export EXL2_CARRIED_LIBRARY=1
source scripts/device/common.sh
begin_card_call bm4 "${BM4_LIMIT:-300}"
use_libraries T=.dev/libexl2_kernels_timeline.so.gz
cp /tmp/libT.so "$LIB"
timeout 120 python3 scripts/gemv_timeline.py --workdir /tmp/models --json "$R/timeline.json" --raw "$R/timeline.npz" \
  > "$R/timeline.txt" 2>&1
echo "rc=$?"; tail -12 "$R/timeline.txt" | cut -c1-160
cp /tmp/libD.so "$LIB"
echo "total $(( $(date +%s) - T0 )) s"
