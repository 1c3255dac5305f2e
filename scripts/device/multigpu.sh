#!/usr/bin/env bash
# Device call for issue 8, on nvidia-h200-x2: the multi-GPU cuda tests (one- and two-GPU), then one GPU vs layer
# split vs tensor parallelism on the 70B shape at 4.0 and 4.25 bpw (scripts/device/multigpu.py): load time,
# batch-1 decode tok/s, planned vs allocated memory per device, greedy identity. JSON: $OUT/multigpu.json.
# About 8 minutes; on one GPU the two-GPU tests and modes are skipped (recorded as skipped).
source scripts/device/common.sh
nvidia-smi --query-gpu=index,name,memory.used,memory.total --format=csv > "$OUT/gpus.txt" 2>&1
nvidia-smi topo -m >> "$OUT/gpus.txt" 2>&1
timeout 120 python3 -m pytest tests/multigpu -q -m cuda -p no:cacheprovider 2>&1 | tee "$OUT/multigpu_tests.txt" | tail -6
timeout 450 python3 scripts/device/multigpu.py --out "$OUT/multigpu.json" --budget-s 300 2>&1 \
  | tee "$OUT/multigpu.txt" | grep -v '^ ' | tail -30
