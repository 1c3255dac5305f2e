#!/usr/bin/env bash
# Device calls BD2-BD5, BD8 and BD10 (session 37; carry .dev/persistent_bound, built here from scripts/device/persistent_bound.cu as
# its header says; ~60 s). BD1: one persistent launch with 128 all-to-all phase boundaries paid ~2.8-3.7 us per
# boundary at every ring depth (24-192 KB), more than 128 bare PDL launches (2.2-2.9 us). Now the launch-per-phase
# side with the library GEMV's parts added one at a time (work items, split-K finish, staged scales, real inputs):
# where the library's ~56 us per 8B layer (chain_bench apart, BD1) goes beyond the bare launches' ~43-46 us.
# BD3 adds kFixed (a fixed-point split-K finish without tickets) after BD2 put ~2.3 us per launch in the finish;
# BD4 kLeft (gate/up leaves its partials, down sums them in its gather); BD5 the same with down gathering in order
# (the library folds its order into gate/up), as the model does since. BD8: the persistent kernel's dependency in
# other forms (no fence before the release, eight spread ticket words with back-off polls) and its input by one bulk
# copy. BD10: everything again with the input's loads eight in flight per thread (they were one after another).
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader
mkdir -p "$OUT/r"
timeout 240 .dev/persistent_bound 2>&1 | tee "$OUT/r/persistent_bound.txt"
