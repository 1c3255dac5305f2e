#!/usr/bin/env bash
# Device call BA4 (session 35; carry .whl and .dev/libexl2_kernels.so.gz; ~400 s). After the random writer's fix
# (format/random_model.center_codes: weights of mean 0):
#  1. the kernels against the reference ops on the same GPU at the 70B's widths (hidden 8192, 64 / 8 heads,
#     intermediate 28672; 4 random layers): scripts/nan_probe.py on each, then --compare (logits of a 40-token
#     prefill, two decode steps and an 8-token prefill);
#  2. the GPU tests that write random directories or draw random weights (prefill memory, multi-GPU on one GPU,
#     the unit suite's device tests), then the engine, speculation and serving suites as time allows.
export EXL2_CARRIED_LIBRARY=1
source scripts/device/common.sh
begin_call ba4
nvidia-smi --query-gpu=name --format=csv,noheader
L=${BA4_LIMIT:-400}
timeout 90 python3 scripts/nan_probe.py --shape llama3-70b --layers 4 --workers 12 --out "$R/k70.pt" > "$R/k70.txt" 2>&1
grep -E "kernels|finite" "$R/k70.txt" | cut -c1-160
EXL2_BACKEND_DISABLE_CUDA=1 timeout 90 python3 scripts/nan_probe.py --shape llama3-70b --layers 4 --out "$R/r70.pt" \
  > "$R/r70.txt" 2>&1
grep -E "kernels|finite" "$R/r70.txt" | cut -c1-160
python3 scripts/nan_probe.py --compare "$R/k70.pt" "$R/r70.pt" 2>&1 | tee "$R/compare70.txt"
rm -f "$R"/*.pt; rm -rf /tmp/nan_probe
echo "elapsed $(( $(date +%s) - T0 )) s"
fits 60 "gpu tests" "$L" && gpu_tests suites "$(left "$((L - 10))")" -n 8 tests/engine/test_prefill_memory.py \
  tests/multigpu tests/unit tests/engine tests/spec tests/serve
echo "total $(( $(date +%s) - T0 )) s"
