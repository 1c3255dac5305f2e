#!/usr/bin/env bash
# Device call N5 (session 9; carry .whl, .dev/libexl2_kernels.so.gz and .dev/libold.so.gz, the library before this
# change). N4's ncu: the fused RMSNorm (q/k/v and gate/up GEMVs, the chain's norm phases) and add_rms_norm issued
# their row loads one after another (each load waited behind the previous vector's residual store, which may
# alias it): 8-12 dependent round trips per launch. Now every load of a row is in flight at once.
#  1. the GPU tests of the norm, the fused-norm GEMV, the GEMV and the chain;
#  2. A/B in one call (old library: EXL2_BACKEND_LIBRARY): the 8B decode step (profile_decode nochain, 1k),
#     verify costs (spec_bench), bench at 1k fp16; the new library's bench at 1k / 32k for fp16 / q8 / q4;
#  3. chain_bench stamps (the norm phases' input stage).
export EXL2_CARRIED_LIBRARY=1
source scripts/device/common.sh
results_dir
trap '[ -d "$R" ] && pack_results n5' EXIT
gunzip -c .dev/libold.so.gz > /tmp/libold.so
OLD=/tmp/libold.so
t=$(date +%s)
gpu_tests kernels 150 tests/kernels/test_layers.py tests/kernels/test_gemv_norm.py tests/kernels/test_exl2_gemm.py \
  tests/kernels/test_gemv_chain.py --timeout 100
echo "tests $(( $(date +%s) - t )) s"; t=$(date +%s)
decode_step_1k new nochain
decode_step_1k old nochain EXL2_BACKEND_LIBRARY=$OLD
decode_step_1k new2 nochain
echo "profile $(( $(date +%s) - t )) s"; t=$(date +%s)
spec_costs new
spec_costs old EXL2_BACKEND_LIBRARY=$OLD
echo "spec $(( $(date +%s) - t )) s"; t=$(date +%s)
EXL2_BACKEND_LIBRARY=$OLD timeout 90 python3 -m exl2_backend.cli.main bench --shape llama3-8b --bpw 4.0 \
  --model-out /tmp/models/llama3-8b --contexts 1024 --cache-type fp16 --json "$R/bench_8b_old.json" \
  > "$R/bench_8b_old.txt" 2>&1
echo "== bench old"; grep -A4 "decode tokens/s by cache" "$R/bench_8b_old.txt" | tail -2
timeout 120 python3 -m exl2_backend.cli.main bench --shape llama3-8b --bpw 4.0 --model-out /tmp/models/llama3-8b \
  --contexts 1024,32768 --cache-type fp16,q8,q4 --json "$R/bench_8b.json" --plot "$R/bench_8b.png" \
  > "$R/bench_8b.txt" 2>&1
echo "== bench new"; grep -A7 "decode tokens/s by cache" "$R/bench_8b.txt" | tail -4
echo "bench $(( $(date +%s) - t )) s"; t=$(date +%s)
EXL2_GEMV_CHAIN_STAMPS=1 timeout 60 python3 scripts/chain_bench.py --m 1,5 --json "$R/cb.json" \
  --stamps-out "$R/stamps" > "$R/cb.txt" 2>&1
grep -E "^M=|M=1 phase" "$R/cb.txt" | cut -c1-200
echo "chain $(( $(date +%s) - t )) s"
