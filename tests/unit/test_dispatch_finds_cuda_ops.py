"""ops/dispatch.py looks up each op by name in ops/cuda.py and silently falls back to the reference where the name
is missing. An op that a CUDA module implements but ops/cuda.py does not export therefore runs as torch ops on the
GPU: from session 8 to 21 the prefill's KV page dequantization did (its kernel existed, its tests called it
directly, dispatch never found it). Host code: runs wherever the compiled library loads."""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import pytest

from exl2_backend.ops import library

pytestmark = pytest.mark.skipif(not library.available(), reason="compiled library not loaded")

CUDA_MODULES = ("cuda_layers", "cuda_kvquant", "cuda_quant")


def _dispatched_names() -> set[str]:
    src = (Path(__file__).resolve().parents[2] / "exl2_backend" / "ops" / "dispatch.py").read_text()
    return set(re.findall(r'_pick(?:_kvquant)?\("(\w+)"', src))


def test_every_dispatched_op_with_a_cuda_implementation_is_exported():
    from exl2_backend.ops import cuda

    names = _dispatched_names()
    assert {"dequantize_pages", "kv_quant_write", "paged_attention_quant"} <= names
    for module in CUDA_MODULES:
        mod = importlib.import_module(f"exl2_backend.ops.{module}")
        for name in sorted(names):
            if callable(getattr(mod, name, None)):
                assert getattr(cuda, name, None) is getattr(mod, name), f"ops.cuda does not export {module}.{name}"


def test_direct_calls_skip_the_dispatcher_for_every_custom_op(monkeypatch):
    """EXL2_BACKEND_DIRECT_OPS: every dispatched CUDA op that is a torch.library custom op has its plain
    implementation in `direct`, and eager dispatch picks it; while torch.compile traces, and with the switch
    off, dispatch keeps the custom op."""
    import torch

    from exl2_backend.ops import cuda, dispatch

    monkeypatch.setattr(library, "DIRECT_OPS", True)
    custom = 0
    for name in sorted(_dispatched_names()):
        op = getattr(cuda, name, None)
        if op is None:
            continue
        picked = dispatch._cuda_impl(cuda, name)
        if isinstance(op, torch._library.custom_ops.CustomOpDef):
            custom += 1
            assert picked is getattr(cuda.direct, name), name
            assert not isinstance(picked, torch._library.custom_ops.CustomOpDef), name
        else:
            assert picked is op, name  # a plain function already (dequantize_pages, exl2_gemm, ...)
    assert custom >= 8
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    assert dispatch._cuda_impl(cuda, "rms_norm") is cuda.rms_norm
    monkeypatch.undo()
    monkeypatch.setattr(library, "DIRECT_OPS", False)
    assert dispatch._cuda_impl(cuda, "rms_norm") is cuda.rms_norm


def test_reference_fallback_returns_the_reference_op_and_says_so_once_per_op(monkeypatch, caplog):
    """A CUDA op that cannot take its inputs runs its reference twin (cuda_layers / cuda_kvquant `_fallback`): the
    warning names the op and the reason the first time only, per reference module and op."""
    from exl2_backend.ops import reference, reference_kvquant

    monkeypatch.setattr(library, "_fallback_warned", set())
    with caplog.at_level("WARNING", logger="exl2_backend"):
        assert library.reference_fallback(reference, "rms_norm", "dtype torch.float64") is reference.rms_norm
        assert library.reference_fallback(reference, "rms_norm", "again") is reference.rms_norm
        assert library.reference_fallback(reference_kvquant, "kv_quant_write", "layout") is \
            reference_kvquant.kv_quant_write
    said = [r.getMessage() for r in caplog.records if "runs the reference op" in r.getMessage()]
    assert said == ["exl2_backend: rms_norm runs the reference op on the GPU: dtype torch.float64",
                    "exl2_backend: kv_quant_write runs the reference op on the GPU: layout"]
