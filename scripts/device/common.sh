# Sourced by the device-call scripts: carried wheels, the CUDA library built for sm_90a, PYTHONPATH.
set -uo pipefail
export PYTHONUNBUFFERED=1 EXL2_BACKEND_ALLOW_MISSING_DEFAULT=1
# ExLlamaV2 JIT-builds its extension into the torch extensions dir: keep it under /tmp, which survives between
# calls on a warm machine (C2/C3 of 2026-12-01 rebuilt it from scratch and timed out: $HOME did not persist).
export TORCH_EXTENSIONS_DIR=/tmp/torch_extensions
if ! python3 -c "import pydantic, litserve" 2>/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
fi
export PYTHONPATH="$PWD:/tmp/site"
if [ "${EXL2_SKIP_BUILD:-0}" != 1 ] && { [ ! -f exl2_backend/_lib/libexl2_kernels.so ] || [ -n "$(find csrc -newer exl2_backend/_lib/libexl2_kernels.so -name "*.cu*")" ]; }; then
  EXL2_BACKEND_CUDA_ARCHS=90a EXL2_BACKEND_BUILD_JOBS=16 python3 setup.py -q build_ext --inplace > "$OUT/build.txt" 2>&1 \
    || { tail -40 "$OUT/build.txt"; exit 1; }
fi
exl2() { python3 -m exl2_backend.cli.main "$@"; }
