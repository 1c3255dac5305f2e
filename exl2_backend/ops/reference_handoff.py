"""Reference of the norm handoff (ops/cuda_handoff.py, csrc/quant/exl2_gemv_handoff.cuh): add_rms_norm split at
the sum of squares. The producer's side turns its output y and the residual stream into the next stream and its
per-256-column partial sums of squares; the consumer's side normalizes the stream from those partials. Chained,
they are add_rms_norm up to the order of that sum."""

from __future__ import annotations

import torch

from exl2_backend.errors import TensorShapeError

BLOCK_COLS = 256  # the producing GEMV's column block: one partial per token and block


def handoff_out(y: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """y, residual [M, H] -> (r = y + residual rounded to y.dtype [M, H], sq fp32 [M, ceil(H / 256)]): each
    block's sum of r^2 (r as rounded)."""
    if y.shape != residual.shape or y.dim() != 2:
        raise TensorShapeError(f"y {tuple(y.shape)} and residual {tuple(residual.shape)} must be the same [M, H]",
                               tensor="residual")
    r = (y.float() + residual.float()).to(y.dtype)
    return r, block_sums(r)


def block_sums(r: torch.Tensor) -> torch.Tensor:
    """r [M, H] -> fp32 [M, ceil(H / 256)]: the sum of r^2 over each 256-column block (the last may be partial)."""
    m, h = r.shape
    ncb = -(-h // BLOCK_COLS)
    sq = torch.zeros(m, ncb * BLOCK_COLS, dtype=torch.float32, device=r.device)
    sq[:, :h] = r.float() ** 2
    return sq.view(m, ncb, BLOCK_COLS).sum(-1)


def handoff_in(r: torch.Tensor, sq: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The stream r [M, H] and its partial sums sq [M, ceil(H / 256)] -> rms_norm(r) * weight [M, H] in r.dtype:
    fp32 math from the summed partials, one rounding at the end."""
    m, h = r.shape
    if sq.shape != (m, -(-h // BLOCK_COLS)):
        raise TensorShapeError(f"sq has shape {tuple(sq.shape)}, expected [{m}, {-(-h // BLOCK_COLS)}]", tensor="sq")
    inv = torch.rsqrt(sq.float().sum(-1, keepdim=True) / h + eps)
    return (r.float() * inv * weight.float()).to(r.dtype)
