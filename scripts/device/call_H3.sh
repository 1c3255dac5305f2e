#!/usr/bin/env bash
# Device call H3 (prepared in session 5; carry .whl and .dev/ with libexl2_kernels{,_early,_early_res3}.so.gz,
# rebuilt together after any csrc change): does the boundary between two launches shrink when the next kernel
# starts earlier? Two measurement builds of the same sources:
#  early       -DEXL2_PDL_EARLY_TRIGGER: the small kernels (norm, rope, attention, reduce, ...) trigger their
#              dependents before waiting, so the GEMV after an rms_norm launches during the GEMV before it;
#  early_res3  and -DEXL2_GEMV_TMA_MT1_MIN_BLOCKS=3: the one-tile GEMV at 72 registers leaves room for a third
#              block per SM (its split-K plan stays at two), so those early blocks become resident and request
#              their first weights before the previous GEMV's blocks retire.
# For each: the kernel tests that cover the changed code, then the 8B decode step (graph replay) and bench_gemm
# --m1 (back-to-back GEMVs).
export EXL2_CARRIED_LIBRARY=1
source scripts/device/common.sh
results_dir
trap '[ -d "$R" ] && pack_results h3' EXIT
for v in early early_res3; do gunzip -c .dev/libexl2_kernels_$v.so.gz > /tmp/lib_$v.so; done
for v in default early early_res3; do
  lib=""; [ $v != default ] && lib=/tmp/lib_$v.so
  t=$(date +%s)
  if [ $v != default ]; then
    EXL2_BACKEND_LIBRARY=$lib gpu_tests "tests_$v" 120 tests/kernels/test_exl2_gemm.py \
      tests/kernels/test_paged_attention.py tests/kernels/test_layers.py --timeout 60 -x
  fi
  EXL2_BACKEND_LIBRARY=$lib timeout 80 python3 scripts/profile_decode.py --shapes llama3-8b --variants after \
    --workdir /tmp/prof --no-check --out "$R" > "$R/profile_$v.txt" 2>&1
  EXL2_BACKEND_LIBRARY=$lib timeout 40 python3 scripts/bench_gemm.py --m1 > "$R/m1_$v.txt" 2>&1
  echo "$v: $(grep -E '########' "$R/profile_$v.txt" | head -1 | sed 's/.*graph step/graph step/')"
  echo "   M1: $(grep M1 "$R/m1_$v.txt" | awk '{printf "%s ", $(NF-10)}') ($(( $(date +%s) - t )) s)"
done
