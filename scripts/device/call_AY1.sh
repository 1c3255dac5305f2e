#!/usr/bin/env bash
# Device call AY1 (session 33, for the next session after call_AX2.sh; carry .whl and .dev/libexl2_kernels.so.gz;
# ~300 s). Verify steps on the tensor-core streamed attention (EXL2_BACKEND_ATTN_STREAM_VERIFY=1, off by default:
# G x Tq query rows per kv head in tiles of 16 as grid z, each row's causal limit; written in session 33, checked
# by a CPU emulation of its fragments, never run on a GPU). Issue 7 wants a k = 4 verify step <= 1.15x a decode step
# (session 31: 1.276 on the H200; the decode step has since become faster, the verify step not yet).
#  1. The streamed kernels' GPU tests, the verify rows' included.
#  2. Where they pass: the 8B attention at 1k for Tq = 5 both ways is inside spec_bench's step costs; verify /
#     decode step costs (spec_bench) with and without the switch, interleaved twice.
export EXL2_CARRIED_LIBRARY=1
source scripts/device/common.sh
begin_call ay1
nvidia-smi --query-gpu=name --format=csv,noheader
gpu_tests_verbose stream 90 -n 12 tests/kernels/test_paged_attention_stream.py tests/engine/test_stream_attention_engine.py
echo "elapsed $(( $(date +%s) - T0 )) s"
if ! grep -qE "FAILED|ERROR" "$R/stream.txt"; then
  interleaved_spec_costs D V=EXL2_BACKEND_ATTN_STREAM_VERIFY=1
fi
echo "total $(( $(date +%s) - T0 )) s"
