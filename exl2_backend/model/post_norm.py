"""A decoder layer's RMSNorms applied at the output of the GEMV after them (ops/cuda_post.py), for CUDA linears.

o and down write the residual stream and its tile sums of squares (their GEMV's finish, or exl2_row_feed after
it); gate/up and the next layer's q/k/v take them and scale their output rows. Routing per consumer depends only on
whether its GEMV takes M rows (cuda_post.posts), so the decode step and a verify step give each row the same bits.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from exl2_backend.model import layers as L


def scaled_norm(linear, weight: torch.Tensor) -> tuple[torch.Tensor, float] | None:
    """The norm weight prepared for a post-norm consumer (cuda_post.scaled_norm_weight), or None where routing is
    off or `linear` is not a CUDA linear. Called at load time (it reads the weight back)."""
    if not (L.FUSED_NORM and hasattr(linear, "launch")
            and all(getattr(part, "xmap", None) is not None for part in linear.launch.parts)):
        return None  # not a CUDA linear of EXL2 parts
    from exl2_backend.ops import cuda_post

    if not cuda_post.POST_NORM:
        return None
    cuda_post.stored_rows(linear)  # the maps a producer scatters its output by, built here (it reads them back)
    return cuda_post.scaled_norm_weight(weight)


def posts(consumer, scaled, m: int) -> bool:
    """Whether `consumer` runs for M rows with its input norm at the output (scaled: scaled_norm's result)."""
    if scaled is None:
        return False
    from exl2_backend.ops import cuda_post

    return cuda_post.posts(consumer, m)


def fed_residual(producer, x: torch.Tensor, residual: torch.Tensor, run: Callable[[], torch.Tensor], consumer,
                 scaled, gated: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(r = producer's output + residual [T, H], its tile sums [T, tiles], y): producer's GEMV writes them, and y =
    consumer's input round(r * w') in its stored row order, where it can (cuda_post.feed; gated: x is gate | up and
    the input silu(gate) * up); else run() gives the output, exl2_row_feed adds the residual and y is None (the
    consumer gathers it). Both give the same bits."""
    from exl2_backend.ops import cuda_post

    fed = cuda_post.feed(producer, x, residual, gated=gated, consumer=consumer, scaled=scaled)
    return fed if fed is not None else cuda_post.row_feed(run(), residual)


def post_normed(consumer, r: torch.Tensor, ss: torch.Tensor, y: torch.Tensor | None, scaled,
                eps: float) -> torch.Tensor:
    """consumer(rms_norm(r) * w) with the norm at its output (cuda_post.post_normed without rope)."""
    from exl2_backend.ops import cuda_post

    return cuda_post.post_normed(consumer, r, ss, scaled, eps, y=y)


def post_qkv(layer, r: torch.Tensor, ss: torch.Tensor, y: torch.Tensor | None,
             step) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """layers.norm_qkv with the norm at the q/k/v GEMV's output: (qkv [T, (Hq + 2 Hkv) D], r, roped); y: the
    producer's pre-gathered input (None: gathered from r). With `step` and an fp16 cache, rope and the KV-cache
    write run inside the GEMV (roped True)."""
    from exl2_backend.ops import cuda_post

    scaled = layer.input_norm_scaled
    if step is not None and L.ROPE_IN_GEMV and L.FUSED_ROPE_KV and not getattr(step.cache, "quantized", False):
        k_cache, v_cache = step.cache.k[layer.index], step.cache.v[layer.index]  # [P, S, Hkv, D]
        if k_cache.dtype == torch.float16:
            rope = (step.positions, step.inv_freq, k_cache, v_cache, step.meta.slots)
            qkv = cuda_post.post_normed(layer.qkv, r, ss, scaled, layer.eps, rope, y=y)
            if qkv is not None:
                return qkv, r, True
    return cuda_post.post_normed(layer.qkv, r, ss, scaled, layer.eps, y=y), r, False


def first_qkv(layer, h: torch.Tensor, residual: torch.Tensor | None, step):
    """The first layer's q/k/v from h (the embedding rows, or a layer split's incoming stream with its residual):
    post_qkv after exl2_row_feed, or None where routing does not post for this many rows."""
    if not posts(layer.qkv, layer.input_norm_scaled, h.shape[0]):
        return None
    from exl2_backend.ops import cuda_post

    r, ss, _ = cuda_post.row_feed(h, residual)
    return post_qkv(layer, r, ss, None, step)
