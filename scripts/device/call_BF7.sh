#!/usr/bin/env bash
# Device call BF7 (session 40; carry .whl and .dev; ~2 min): the ceiling of a verify step without its pre-gathering
# norm launches (EXL2_BACKEND_MEASURE_SKIP_NORM_PREGATHER=1: results wrong, the GEMV reads a stale stored-order
# buffer): spec_bench's step costs with and without, interleaved twice. Session 33's AF3 put those 65 launches at
# ~306 us of a k = 4 verify's critical path; the question is what removing them saves where launches overlap.
# Ran once in session 40 (H100): the default's k = 4 verify 1.241 / 1.241 of a 2.308 / 2.300 ms decode step; the
# switch's runs lost their figures, since spec_bench then timed whole engine steps and the engine's NaN guard
# failed the sequence (the skipped norm leaves the residual stream unwritten). SPEC_SKIP=engine times the graphs
# only.
export EXL2_CARRIED_LIBRARY=1
source scripts/device/common.sh
begin_call bf7
nvidia-smi --query-gpu=name --format=csv,noheader
SPEC_SKIP=engine interleaved_spec_costs default skip=EXL2_BACKEND_MEASURE_SKIP_NORM_PREGATHER=1
echo "total $(( $(date +%s) - T0 )) s"
