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


def test_the_norm_at_the_output_declines_linears_without_the_gemv(monkeypatch):
    """ops/cuda_post.py routes only CUDA linears: the reference LinearOp (CPU) keeps the norm as its own op at every
    M, and model/post_norm.py prepares no weight for it; the tile sums per row are one per 256-column block; the
    norm weight's power-of-two scale covers its largest magnitude."""
    from exl2_backend.model import post_norm
    from exl2_backend.ops import cuda_post
    from tests.helpers.synth import random_qtensor

    monkeypatch.setattr(cuda_post, "POST_NORM", True)
    lin = ops.prepare_linear([random_qtensor("a", 64, 64, "4:1@32", seed=1)], "cpu", torch.float32)
    assert not any(cuda_post.posts(lin, m) for m in (1, 5, 32)) and not cuda_post.can_feed(lin, 1)
    assert post_norm.scaled_norm(lin, torch.ones(64)) is None and not post_norm.posts(lin, None, 1)
    assert [cuda_post.tiles(h) for h in (1, 256, 257, 576, 4096, 8192)] == [1, 1, 2, 3, 16, 32]
    for peak, want in ((0.3, 1.0), (1.0, 1.0), (1.5, 2.0), (3.0, 4.0), (4.0, 4.0)):
        w = torch.tensor([0.1, -peak, 0.2], dtype=torch.float16)
        w_scaled, mul = cuda_post.scaled_norm_weight(w)
        assert mul == want and torch.equal(w_scaled * mul, w)
