"""Parts of an EXL2 `QTensor` as valid QTensors of their own, for tensor parallelism.

- `select_columns`: any subset of output columns, in any order. Columns of q_weight are independent (each
  column is its own bit stream), so this is a gather plus re-padding to a multiple of 32; the 4-bit scale
  codes are unpacked, gathered and re-packed.
- `select_group_rows`: a contiguous range of *stored* rows made of whole groups. Rows are stored in
  activation order (q_invperm), so the original input features of the range are `q_perm[r0:r1]`, generally
  scattered. The slice's local input feature j is the one stored at its row j (identity invperm); the
  caller feeds it `x[:, features]` -- or, better, makes the previous layer produce exactly those features
  (model/tp_shard.py).

Dequantizing a part equals the same part of the full dequantization bit for bit (tests/unit/test_qtensor_slice.py).
"""

from __future__ import annotations

import itertools

import torch

from exl2_backend.errors import TensorShapeError
from exl2_backend.format.packing import pack_columns, pack_scales, unpack_scales
from exl2_backend.format.qtensor import QTensor, pad32


def select_columns(qt: QTensor, cols: torch.Tensor) -> QTensor:
    """A QTensor whose output column j is column cols[j] of `qt` (cols: int [n], values < out_features)."""
    cols = cols.to(dtype=torch.long).flatten()
    n = int(cols.numel())
    if n == 0 or int(cols.min()) < 0 or int(cols.max()) >= qt.out_features:
        raise TensorShapeError(f"column selection must be non-empty and within [0, {qt.out_features})",
                               path=qt.source, tensor=f"{qt.key}.q_weight")
    np_ = pad32(n)
    dev = qt.q_weight.device
    q_weight = qt.q_weight.index_select(1, cols.to(dev))  # [qrows, n]
    codes = unpack_scales(qt.q_scale.cpu()).index_select(1, cols.cpu())  # [G, n]
    bias = None if qt.bias is None else qt.bias.index_select(0, cols.to(qt.bias.device))  # [n]
    if np_ > n:  # padding columns hold the zero point (decode to 0) and scale code 0, like the converter's
        pad = [pack_columns(torch.full((g.rows, 1), 1 << (g.bits - 1)), g.bits) for g in qt.groups]
        pad_cols = torch.cat(pad, dim=0).to(dev).expand(-1, np_ - n)  # [qrows, Np - n]
        q_weight = torch.cat([q_weight, pad_cols], dim=1)
        codes = torch.cat([codes, codes.new_zeros(codes.shape[0], np_ - n)], dim=1)
        if bias is not None:
            bias = torch.cat([bias, bias.new_zeros(np_ - n)])
    out = QTensor(key=qt.key, q_weight=q_weight.contiguous(), q_scale=pack_scales(codes).to(dev),
                  q_scale_max=qt.q_scale_max, q_groups=qt.q_groups, q_invperm=qt.q_invperm, out_features=n,
                  bias=bias, source=qt.source)
    return out


def select_group_rows(qt: QTensor, g0: int, g1: int) -> tuple[QTensor, torch.Tensor]:
    """Groups [g0, g1) of `qt` as a QTensor, and the original input features of its rows (int64 [rows]):
    local row j holds original feature features[j], and the slice's invperm is the identity."""
    groups = qt.groups
    if not 0 <= g0 < g1 <= len(groups):
        raise TensorShapeError(f"group range [{g0}, {g1}) outside the {len(groups)} groups", path=qt.source,
                               tensor=f"{qt.key}.q_groups")
    first, last = groups[g0], groups[g1 - 1]
    q0 = first.qrow_start
    q1 = last.qrow_start + last.rows * last.bits // 32
    r0, r1 = first.row_start, last.row_start + last.rows
    q_groups = torch.tensor([v for g in groups[g0:g1] for v in (g.bits, g.qrow_start - q0)], dtype=torch.int16)
    features = qt.q_perm.long()[r0:r1]  # [rows]: stored row r0 + j holds original feature features[j]
    # scales are copied: a prepared op keeps its q_scale, and a view would keep the whole tensor alive
    part = QTensor(key=qt.key, q_weight=qt.q_weight[q0:q1], q_scale=qt.q_scale[g0:g1].clone(),
                   q_scale_max=qt.q_scale_max[g0:g1].clone(), q_groups=q_groups.to(qt.q_groups.device),
                   q_invperm=torch.arange(r1 - r0, dtype=torch.int32, device=qt.q_invperm.device),
                   out_features=qt.out_features, bias=qt.bias, source=qt.source)
    return part, features


def balanced_group_ranges(qt: QTensor, parts: int) -> list[tuple[int, int]]:
    """Split the groups into `parts` contiguous ranges with row counts as equal as group boundaries allow."""
    try:
        return balanced_ranges([g.rows for g in qt.groups], parts)
    except ValueError as exc:
        raise TensorShapeError(str(exc), path=qt.source, tensor=f"{qt.key}.q_groups") from None


def balanced_ranges(sizes: list[int], parts: int) -> list[tuple[int, int]]:
    """Contiguous ranges [a, b) of items with `sizes`, one per part (none empty), whose size sums are as equal
    as the item boundaries allow (each cut at the boundary nearest its ideal position)."""
    if parts < 1 or parts > len(sizes):
        raise ValueError(f"cannot split {len(sizes)} groups into {parts} non-empty parts")
    ends = list(itertools.accumulate(sizes))  # size sum up to and including each item
    total = ends[-1]
    bounds = [0]
    for p in range(1, parts):
        target = total * p / parts
        lo = bounds[-1] + 1  # at least one item per part, and room for the parts after this one
        hi = len(sizes) - (parts - p)
        bounds.append(min(range(lo, hi + 1), key=lambda i: (abs(ends[i - 1] - target), i)))
    bounds.append(len(sizes))
    return list(itertools.pairwise(bounds))
