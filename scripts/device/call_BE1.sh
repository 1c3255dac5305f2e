#!/usr/bin/env bash
# Device call BE1 (session 39; fresh machine; carry .whl, .dev incl. lib_late.so.gz, .gga; ~7 min). The GEMV ring
# slot released after the chunk's arithmetic (EXL2_GEMV_RELEASE_LATE, scripts/build_variant.sh) against the default
# proxy fence before the release: race_probe.py and the GEMV GPU tests on the variant, then the 8B step costs of
# both interleaved twice. Also: the first part of the SmolLM2 GGUF kept in /tmp/smol for BE3 (the file does not fit
# one call's carry), ExLlamaV2's JIT build (kept under /tmp/torch_extensions for BE3). BE2 must follow within 30 s.
# The macro was removed after this call (the release after the arithmetic cost +0.9% per decode step); rerunning
# it needs it back in exl2_gemv_tma.cuh (commit 8f02677) and the variant built with scripts/build_variant.sh.
# (It ran with a plain copy of its GGUF part; common.sh's keep_gguf_parts does that since.)
export EXL2_CARRIED_LIBRARY=1
source scripts/device/common.sh
begin_call be1
keep_gguf_parts
nvidia-smi --query-gpu=name --format=csv,noheader
start_exllamav2_jit
use_libraries L=.dev/lib_late.so.gz
cp /tmp/libL.so "$LIB"
race_probe probe_late 3000 "--no-nan --only down_gated_m2,gate_up_norm_m1,gate_up_norm_m2"
gpu_tests_verbose gemv_tests_late 170 -n 8 $GEMV_GPU_TESTS tests/kernels/test_gemv_repeat_identical.py
cp /tmp/libD.so "$LIB"
wait $JIT; tail -1 "$OUT/exl_jit.txt"; mv "$OUT/exl_jit.txt" "$R/"
echo "elapsed $(( $(date +%s) - T0 )) s"
for round in 1 2; do
  cp /tmp/libL.so "$LIB"; fits 60 "spec late $round" && spec_costs "late$round"
  cp /tmp/libD.so "$LIB"; fits 60 "spec fence $round" && spec_costs "fence$round"  # last: BE3 reads its costs.json
done
cp /tmp/libD.so "$LIB"
echo "total $(( $(date +%s) - T0 )) s"
