"""The norm-fused GEMV's host side without a GPU: the threads per row it shares with rms_norm_kernel, and
model.layers.norm_linear falling back to add_rms_norm + the linear where the linear cannot normalize its input
(the reference LinearOp on CPU)."""

from __future__ import annotations

import math

import pytest
import torch

from exl2_backend import ops
from exl2_backend.model import layers
from exl2_backend.ops.cuda_quant import norm_row_threads


@pytest.mark.parametrize("k", [8, 128, 576, 1056, 2048, 3072, 4096, 5120, 8192])
def test_norm_row_threads_is_the_rms_kernels_block_size(k):
    """csrc/layers/norm.cu launch(): K / 8 vectors, four per thread, rounded up to a warp, at least one warp."""
    want = max(32, math.ceil(math.ceil(k / 8 / 4) / 32) * 32)
    assert norm_row_threads(k) == want
    assert 4 * norm_row_threads(k) >= k // 8  # every vector has a thread: the fused kernel has no tail loop


@pytest.mark.parametrize("with_residual", [False, True])
@pytest.mark.parametrize("fused", [False, True])
def test_norm_linear_without_a_fusing_linear_runs_the_two_ops(monkeypatch, with_residual, fused):
    from tests.helpers.synth import random_qtensor

    monkeypatch.setattr(layers, "FUSED_NORM", fused)
    qt = random_qtensor("t", 64, 48, "4:1@32", seed=1)
    lin = ops.prepare_linear([qt], "cpu", torch.float32)
    assert not hasattr(lin, "add_normed")
    g = torch.Generator().manual_seed(0)
    h, res, w = torch.randn(3, 64, generator=g), torch.randn(3, 64, generator=g), torch.rand(64, generator=g) + 0.5
    y, stream = layers.norm_linear(lin, h, res if with_residual else None, w, 1e-5)
    if with_residual:
        x, want_stream = ops.add_rms_norm(h, res.clone(), w, 1e-5)
    else:
        x, want_stream = ops.rms_norm(h, w, 1e-5), h
    assert torch.equal(stream, want_stream)
    assert torch.equal(y, lin(x))
