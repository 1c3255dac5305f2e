#!/usr/bin/env bash
# Device call BD25 (session 38; carry .whl and .dev; ~3 min): `exl2-backend bench` of the random 8B at 1k with an
# fp16 cache on the fixed library (the proxy fence costs +7-9 us per decode step in BD23's spec_bench).
export EXL2_CARRIED_LIBRARY=1
source scripts/device/common.sh
begin_call bd25
nvidia-smi --query-gpu=name --format=csv,noheader
bench_8b fixed 200 1024 fp16
echo "total $(( $(date +%s) - T0 )) s"
