#!/usr/bin/env bash
# Device call U1 (prepared in session 11 for the next one; carry .whl and .dev/libexl2_kernels.so.gz; not yet run):
# which GEMV carries the launch overhead. profile_decode now labels each GEMV launch of the 8B decode step by role
# (q/k/v, o, gate/up, down, head; scripts/gemv_roles.py) and prints, per role, its critical-path time against the
# time its weights and scales take at the read bandwidth it measures. At 1k and 32k (fp16 cache), the default
# path, and at 1k with the rope apart (EXL2_BACKEND_ROPE_IN_GEMV=0: the q/k/v GEMV without its epilogue).
export EXL2_CARRIED_LIBRARY=1
source scripts/device/common.sh
begin_call u1
for v in "k1 1024" "k32 32768" "k1_apart 1024 EXL2_BACKEND_ROPE_IN_GEMV=0"; do
  set -- $v; name=$1; ctx=$2; shift 2
  env "$@" timeout 120 python3 scripts/profile_decode.py --shapes llama3-8b --variants nochain --workdir /tmp/prof \
    --context "$ctx" --cache-types fp16 --out "$R/p_$name" > "$R/prof_$name.txt" 2>&1
  echo "== $name"; grep -E "^######## " "$R/prof_$name.txt" | cut -c1-140
  grep -A7 "GEMVs by role" "$R/prof_$name.txt"
done
echo "total $(( $(date +%s) - T0 )) s"
