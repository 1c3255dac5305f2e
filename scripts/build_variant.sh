#!/usr/bin/env bash
# A measurement build of the CUDA library for the H200 (sm_90a, with PTX): every csrc/*.cu compiled with -DMACRO
# (several: "A=4 B", one -D each) and linked as setup.py links the default library, gzipped for a device call's
# carry list.
#
#     bash scripts/build_variant.sh EXL2_GEMV_TMA_MT1_MIN_BLOCKS=3 .dev/libexl2_kernels_mt1b3.so.gz
#
# A source whose preprocessed text does not change with the macro reuses the default build's object
# (build/temp*/csrc/, from `EXL2_BACKEND_CUDA_ARCHS=90a pip install -e .`) when one is there and newer than the
# source and the headers it includes; the others compile,
# EXL2_BACKEND_BUILD_JOBS at a time (default 2).
set -euo pipefail
cd "$(dirname "$0")/.."
macro=$1
defines=()
for m in $macro; do defines+=(-D"$m"); done
out=$2
nvcc=${EXL2_BACKEND_NVCC:-nvcc}
jobs=${EXL2_BACKEND_BUILD_JOBS:-2}
gencode=(-gencode arch=compute_90a,code=sm_90a -gencode arch=compute_90,code=compute_90)
flags=(-O3 -std=c++17 --use_fast_math -Xcompiler -fPIC -Xcompiler -fvisibility=hidden -I csrc -lineinfo
  --expt-relaxed-constexpr "${gencode[@]}")
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
default_objs=$(ls -d build/temp*/csrc 2>/dev/null | head -1 || true)
objs=()
todo=()
for src in $(find csrc -name "*.cu" | sort); do
  name=$(echo "${src#csrc/}" | tr / _).o
  reuse=""
  # (only an object newer than the source and every csrc/ header it includes: an edit since makes it stale)
  if [ -n "$default_objs" ] && [ -f "$default_objs/$name" ] && [ -z "$("$nvcc" -M -std=c++17 -I csrc -arch=sm_90a "$src" \
      | tr -d '\\' | tr ' ' '\n' | grep '^csrc/' | while read -r dep; do [ "$dep" -nt "$default_objs/$name" ] && echo "$dep"; done)" ]; then
    # the same translation unit with and without the macro (host and sm_90a device passes): the default object
    if cmp -s <("$nvcc" -E -std=c++17 -I csrc -arch=sm_90a "$src" 2>/dev/null) \
              <("$nvcc" -E -std=c++17 -I csrc -arch=sm_90a "${defines[@]}" "$src" 2>/dev/null); then
      reuse="$default_objs/$name"
    fi
  fi
  if [ -n "$reuse" ]; then
    objs+=("$reuse")
  else
    objs+=("$tmp/$name")
    todo+=("$src")
  fi
done
echo "build_variant: ${defines[*]}: ${#todo[@]} sources to compile: ${todo[*]}"
printf '%s\n' "${todo[@]}" | xargs -P "$jobs" -I{} sh -c \
  'src={}; "$0" "$@" -c "$src" -o '"$tmp"'/$(echo "${src#csrc/}" | tr / _).o' "$nvcc" "${flags[@]}" "${defines[@]}"
"$nvcc" -shared "${gencode[@]}" -cudart static -o "$tmp/lib.so" "${objs[@]}"
mkdir -p "$(dirname "$out")"
gzip -c "$tmp/lib.so" > "$out"
echo "build_variant: $out"
