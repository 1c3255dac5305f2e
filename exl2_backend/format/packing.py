"""Bit packing of EXL2 tensors (the on-disk layout, exl2-format.md b.3/b.4), in plain torch.

Each output column holds, per group, a little-endian bit stream: value k of a group occupies stream bits
[k*b, (k+1)*b), stream bit j is bit (j mod 32) of packed row (j div 32). 32 values fill exactly b words.
These functions are the spec every CUDA decoder must match bit for bit.
"""

from __future__ import annotations

import torch

from exl2_backend.errors import UnsupportedBitWidthError

_WIDTHS = (2, 3, 4, 5, 6, 8)


def _check_bits(bits: int) -> None:
    if bits not in _WIDTHS:
        raise UnsupportedBitWidthError(f"bit width {bits} is not one of {_WIDTHS}")


def pack_columns(values: torch.Tensor, bits: int) -> torch.Tensor:
    """values: int [rows, Np] in [0, 2^bits) with rows % 32 == 0  ->  int32 [rows * bits / 32, Np]."""
    _check_bits(bits)
    rows, np_ = values.shape
    if rows % 32:
        raise UnsupportedBitWidthError(f"pack_columns needs a multiple of 32 rows, got {rows}")
    v = values.to(torch.int64)
    if v.numel() and (v.min() < 0 or v.max() >= (1 << bits)):
        raise ValueError(f"values out of range for {bits}-bit packing")
    # bit j of the stream for every column: [rows * bits, Np]
    shifts = torch.arange(bits, dtype=torch.int64)
    stream = ((v.unsqueeze(1) >> shifts.view(1, bits, 1)) & 1).reshape(rows * bits, np_)
    words = stream.reshape(rows * bits // 32, 32, np_)
    weights = (torch.ones(32, dtype=torch.int64) << torch.arange(32, dtype=torch.int64)).view(1, 32, 1)
    packed = (words * weights).sum(dim=1)  # [qrows, Np], values in [0, 2^32)
    return _u32_to_i32(packed)


def unpack_columns(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """packed: int32 [qrows, Np]  ->  int32 [qrows * 32 / bits, Np], values in [0, 2^bits)."""
    _check_bits(bits)
    qrows, np_ = packed.shape
    if (qrows * 32) % bits:
        raise UnsupportedBitWidthError(f"{qrows} packed rows do not hold whole {bits}-bit values")
    u = packed.to(torch.int64) & 0xFFFFFFFF
    stream = (u.unsqueeze(1) >> torch.arange(32, dtype=torch.int64).view(1, 32, 1)) & 1  # [qrows, 32, Np]
    stream = stream.reshape(qrows * 32 // bits, bits, np_)
    weights = (torch.ones(bits, dtype=torch.int64) << torch.arange(bits, dtype=torch.int64)).view(1, bits, 1)
    return (stream * weights).sum(dim=1).to(torch.int32)


def pack_scales(codes: torch.Tensor) -> torch.Tensor:
    """codes: int [G, Np] in [0, 16) (stored code = qscale - 1)  ->  int32 [G, Np / 8], 8 nibbles per word."""
    g, np_ = codes.shape
    if np_ % 8:
        raise ValueError(f"scale codes need a multiple of 8 columns, got {np_}")
    c = codes.to(torch.int64)
    if c.numel() and (c.min() < 0 or c.max() > 15):
        raise ValueError("scale codes must be in [0, 15]")
    nib = c.reshape(g, np_ // 8, 8) << (4 * torch.arange(8, dtype=torch.int64))
    return _u32_to_i32(nib.sum(dim=-1))


def unpack_scales(q_scale: torch.Tensor) -> torch.Tensor:
    """q_scale: int32 [G, Np / 8]  ->  int32 codes [G, Np] in [0, 16)."""
    g, w = q_scale.shape
    u = q_scale.to(torch.int64) & 0xFFFFFFFF
    nib = (u.unsqueeze(-1) >> (4 * torch.arange(8, dtype=torch.int64))) & 15
    return nib.reshape(g, w * 8).to(torch.int32)


def _u32_to_i32(u: torch.Tensor) -> torch.Tensor:
    return torch.where(u >= (1 << 31), u - (1 << 32), u).to(torch.int32)
