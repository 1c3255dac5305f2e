"""Which norms run as a handoff (model/layers.takes_handoff): EXL2_BACKEND_NORM_HANDOFF "0" (the default) never,
"all" before every linear that has a CUDA launch, "verify" only where the norm would not fuse into the GEMV in one
pass (_Launch.takes_norm); never with FUSED_NORM off or a linear without a launch (the CPU reference ops)."""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest

from exl2_backend.model import layers


def _linear(fused_rows: int):
    return SimpleNamespace(launch=SimpleNamespace(takes_norm=lambda m: m <= fused_rows))


def test_the_default_is_off():
    assert layers.NORM_HANDOFF == os.environ.get("EXL2_BACKEND_NORM_HANDOFF", "0")
    if layers.NORM_HANDOFF == "0":
        assert not layers.takes_handoff(_linear(2), 5)


@pytest.mark.parametrize("mode,want", [("0", [False, False, False]), ("all", [True, True, True]),
                                       ("verify", [False, False, True])])
def test_modes(monkeypatch, mode, want):
    monkeypatch.setattr(layers, "NORM_HANDOFF", mode)
    assert [layers.takes_handoff(_linear(2), m) for m in (1, 2, 5)] == want
    assert not layers.takes_handoff(SimpleNamespace(), 5)  # no CUDA launch
    monkeypatch.setattr(layers, "FUSED_NORM", False)
    assert not layers.takes_handoff(_linear(2), 5)
