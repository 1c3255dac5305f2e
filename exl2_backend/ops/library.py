"""Loads the compiled CUDA library (csrc/ -> exl2_backend/_lib/libexl2_kernels.so) with ctypes.

The library has a plain C ABI: raw device pointers, sizes and a cudaStream_t; every function returns an
int status (0 = ok, else a cudaError_t or one of our EXL2_ERR_* codes) and `exl2_last_error()` gives the
message. Loading never raises: a missing library or no GPU means the reference ops run, said once in the log.
Set EXL2_BACKEND_LIBRARY to load a library from another path; EXL2_BACKEND_DISABLE_CUDA=1 to force the
reference path.
"""

from __future__ import annotations

import ctypes
import logging
import os
from pathlib import Path

from exl2_backend.errors import KernelUnavailableError

log = logging.getLogger("exl2_backend")

_lib: ctypes.CDLL | None = None
_error: str | None = None
_tried = False

# Argument type shorthands for signatures declared by the ops modules.
PTR = ctypes.c_void_p
I32 = ctypes.c_int32
I64 = ctypes.c_int64
F32 = ctypes.c_float
STREAM = ctypes.c_void_p


def library_path() -> Path:
    override = os.environ.get("EXL2_BACKEND_LIBRARY")
    if override:
        return Path(override)
    return Path(__file__).resolve().parent.parent / "_lib" / "libexl2_kernels.so"


# Must equal exl2_abi_version() of csrc/common/api.cu.
ABI_VERSION = 14


def _load() -> None:
    global _lib, _error, _tried
    if _tried:
        return
    _tried = True
    if os.environ.get("EXL2_BACKEND_DISABLE_CUDA") == "1":
        _error = "disabled by EXL2_BACKEND_DISABLE_CUDA=1"
    else:
        path = library_path()
        if not path.exists():
            _error = f"{path} not found (built only where nvcc is present)"
        else:
            try:
                lib = ctypes.CDLL(str(path))
                lib.exl2_last_error.restype = ctypes.c_char_p
                lib.exl2_abi_version.restype = ctypes.c_int
                found = lib.exl2_abi_version()
                if found != ABI_VERSION:  # an old build: calling it with today's signatures could crash
                    _error = f"{path} has C ABI {found}, this package needs {ABI_VERSION}; rebuild it (pip install .)"
                else:
                    _lib = lib
                    _apply_pdl_setting(lib)
            except (OSError, AttributeError) as exc:
                _error = f"could not load {path}: {exc}"
    if _error is not None:
        log.info("exl2_backend: CUDA library unavailable (%s); using reference ops", _error)


def _apply_pdl_setting(lib) -> None:
    """Programmatic dependent launch (csrc/common/pdl.cuh) on sm_90+ unless EXL2_BACKEND_PDL=0."""
    lib.exl2_set_pdl.argtypes = [ctypes.c_int]
    lib.exl2_set_pdl.restype = ctypes.c_int
    if os.environ.get("EXL2_BACKEND_PDL", "1") == "0":
        lib.exl2_set_pdl(0)


def set_pdl(on: bool) -> bool:
    """Turn programmatic dependent launches on or off for launches (and graph captures) from now on; returns
    whether they are on (never on below sm_90). Benchmarks compare both in one process."""
    return bool(get().exl2_set_pdl(1 if on else 0))


# Eager calls of the CUDA ops skip the torch.library dispatcher where a plain implementation is kept (cuda_layers
# `direct`, the quantized linear's dequantization): the same function the custom op runs, without its ~20-25 us per
# call. A 2k prefill of the 8B makes ~450 such calls, and it is bound by the host (session 21: 86 ms of wall time
# around ~53 ms of kernels). Code that torch.compile traces keeps the custom ops. Off until measured on the GPU
# (prepared call AL2); EXL2_BACKEND_DIRECT_OPS=1 turns it on.
DIRECT_OPS = os.environ.get("EXL2_BACKEND_DIRECT_OPS", "0") == "1"


def direct_calls() -> bool:
    """Whether an op may be called without the torch.library dispatcher now (DIRECT_OPS, and not tracing)."""
    if not DIRECT_OPS:
        return False
    import torch

    return not torch.compiler.is_compiling()


def available() -> bool:
    _load()
    return _lib is not None


def load_error() -> str | None:
    _load()
    return _error


def get() -> ctypes.CDLL:
    """The loaded library; raises KernelUnavailableError if it is not there."""
    _load()
    if _lib is None:
        raise KernelUnavailableError(f"CUDA library unavailable: {_error}")
    return _lib


_fallback_warned: set[tuple[str, str]] = set()


def reference_fallback(reference_module, op: str, why: str):
    """`reference_module.op`, for a CUDA op that cannot take its inputs (why: what it could not take), saying so
    once per op: the GPU then runs the pure-torch reference op."""
    key = (reference_module.__name__, op)
    if key not in _fallback_warned:
        _fallback_warned.add(key)
        log.warning("exl2_backend: %s runs the reference op on the GPU: %s", op, why)
    return getattr(reference_module, op)


def declare(name: str, *argtypes) -> ctypes._CFuncPtr:
    """Declare a C function's argument types (all return int status) and return it."""
    fn = getattr(get(), name)
    fn.argtypes = list(argtypes)
    fn.restype = ctypes.c_int
    return fn


def check(status: int, what: str) -> None:
    """Turn a nonzero status from the library into a typed error carrying the library's message."""
    if status != 0:
        msg = get().exl2_last_error()
        raise KernelUnavailableError(f"{what} failed (status {status}): {msg.decode() if msg else 'unknown'}")
