#!/usr/bin/env bash
# What a device call carries beside the git tree, rebuilt on a fresh checkout (a new session's checkout has none
# of the ignored folders, and before session 41 the wheel list was nowhere in the repository):
#   .whl/  the Python packages the device image lacks (its list: /work/.library/device/KINDS.md), as CPython 3.12
#          manylinux wheels (glibc up to 2.39, the image's Ubuntu 24.04), pinned to the versions the CI venv installs (pip freeze of `pip install -e .[test]`);
#          exllamav2 0.3.2 for the side-by-side runs (a pure wheel; it JIT-builds its extension there)
#   .dev/  the CUDA library built here for sm_90a, gzipped, with the hash of the csrc/ it was built from
#          (pack_library.sh; skipped with --no-library or when nvcc is missing)
#   .dev/libE.so.gz  with --baseline REV: the library of REV's csrc/ (built in a git worktree), for calls that time
#          the current library against an earlier one on the same machine (common.sh interleaved_steps, /tmp/lib<L>.so)
#   .gga/ .ggb/ .ggc/  the default model's GGUF in three parts (split_default_gguf.sh; --no-gguf skips them)
#
# Run it from the Python the README's test command installed into (it imports exl2_backend to find the GGUF and
# needs nvcc for the library), e.g. after `python3.11 -m venv /tmp/venv && . /tmp/venv/bin/activate` and that command:
#
#     bash scripts/device/prepare_carry.sh [--no-library] [--no-gguf] [--baseline REV]
set -euo pipefail
cd "$(dirname "$0")/../.."
library=1 gguf=1 baseline=""
while [ $# -gt 0 ]; do
  case "$1" in
    --no-library) library=0 ;;
    --no-gguf) gguf=0 ;;
    --baseline) baseline=${2:?--baseline needs a revision}; shift ;;
    *) echo "unknown argument $1" >&2; exit 2 ;;
  esac
  shift
done
for d in /.whl/ /.dev/ '/.gg*/'; do
  grep -qxF "$d" .git/info/exclude 2>/dev/null || echo "$d" >> .git/info/exclude
done

# Everything the serving, grammar, GGUF and client code imports that the image does not hold, with what those
# need in turn (pydantic's core and typing helpers, litserve's zmq, fastapi's starlette, openai's httpx2 stack).
wheels=(
  pydantic==2.14.4 pydantic_core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5 typing_extensions==4.16.0
  litserve==0.2.19 fastapi==0.165.0 starlette==1.10.0 uvicorn==0.55.0 pyzmq==27.3.0 opentelemetry-api==1.45.3
  annotated-doc==0.0.7 anyio==4.16.0 sniffio==1.3.1
  gguf==0.19.0 llguidance==1.9.1 platformdirs==4.14.9
  openai==3.63.0 httpx2==2.17.0 httpcore2==2.17.0 truststore==0.10.5 jiter==0.19.0
  exllamav2==0.3.2
)
platforms=()
for n in 39 35 34 31 28 27 24 17 5; do platforms+=(--platform "manylinux_2_${n}_x86_64"); done
platforms+=(--platform manylinux2014_x86_64 --platform manylinux1_x86_64)
rm -rf .whl && mkdir -p .whl
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  "${platforms[@]}" -d .whl "${wheels[@]}"
echo ".whl: $(ls .whl | wc -l) wheels, $(du -sh .whl | cut -f1)"

if [ "$library" = 1 ]; then
  if command -v nvcc > /dev/null || [ -x /usr/local/cuda/bin/nvcc ]; then
    lib=exl2_backend/_lib/libexl2_kernels.so
    if [ ! -f "$lib" ] || [ -n "$(find csrc -newer "$lib" \( -name "*.cu*" -o -name "*.h" \) | head -1)" ]; then
      EXL2_BACKEND_CUDA_ARCHS=90a EXL2_BACKEND_BUILD_JOBS="$(nproc)" python3 setup.py -q build_ext --inplace
    fi
    bash scripts/device/pack_library.sh
  else
    echo "no nvcc: .dev not built (the device builds the library itself without EXL2_CARRIED_LIBRARY=1)"
  fi
fi

if [ -n "$baseline" ]; then
  wt=$(mktemp -d /tmp/baseline.XXXXXX)
  git worktree add -q --detach "$wt" "$baseline"
  (cd "$wt" && EXL2_BACKEND_CUDA_ARCHS=90a EXL2_BACKEND_BUILD_JOBS="$(nproc)" python3 setup.py -q build_ext --inplace \
     > "$wt.log" 2>&1) || { tail -20 "$wt.log"; exit 1; }
  mkdir -p .dev && gzip -c "$wt/exl2_backend/_lib/libexl2_kernels.so" > .dev/libE.so.gz
  git worktree remove --force "$wt"
  echo ".dev/libE.so.gz: the library of $(git rev-parse --short "$baseline"), $(du -h .dev/libE.so.gz | cut -f1)"
fi

if [ "$gguf" = 1 ]; then
  bash scripts/device/split_default_gguf.sh
fi
