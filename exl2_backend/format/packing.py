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
    # One 32-row unit = `bits` words per column; value k of the unit starts at stream bit k*bits.
    # Walking the 32 value slots keeps memory at O(values) (a per-bit expansion would be 32x larger).
    v = v.reshape(rows // 32, 32, np_)
    words = torch.zeros(rows // 32, bits, np_, dtype=torch.int64)
    for k in range(32):
        w, s = divmod(k * bits, 32)
        words[:, w] |= (v[:, k] << s) & 0xFFFFFFFF
        if s + bits > 32:  # straddles into the next word: its top bits go to the low end of word w+1
            words[:, w + 1] |= v[:, k] >> (32 - s)
    return _u32_to_i32(words.reshape(rows // 32 * bits, np_))


def unpack_columns(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """packed: int32 [qrows, Np]  ->  int32 [qrows * 32 / bits, Np], values in [0, 2^bits)."""
    _check_bits(bits)
    qrows, np_ = packed.shape
    if (qrows * 32) % bits:
        raise UnsupportedBitWidthError(f"{qrows} packed rows do not hold whole {bits}-bit values")
    units = -(-qrows // bits)  # a partial last unit (e.g. 16 rows of 6-bit) is zero-padded, then cut off
    u = torch.zeros(units * bits, np_, dtype=torch.int64)
    u[:qrows] = packed.to(torch.int64) & 0xFFFFFFFF
    u = u.reshape(units, bits, np_)
    out = torch.empty(units, 32, np_, dtype=torch.int64)
    mask = (1 << bits) - 1
    for k in range(32):
        w, s = divmod(k * bits, 32)
        v = u[:, w] >> s
        if s + bits > 32:
            v = v | (u[:, w + 1] << (32 - s))
        out[:, k] = v & mask
    return out.reshape(units * 32, np_)[: qrows * 32 // bits].to(torch.int32)


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
