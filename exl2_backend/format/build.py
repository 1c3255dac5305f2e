"""Assemble a QTensor from unpacked quantized values, scale codes and a group layout (the packing step)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from exl2_backend.errors import TensorShapeError, UnsupportedBitWidthError
from exl2_backend.format.packing import pack_columns, pack_scales
from exl2_backend.format.qtensor import QTensor, pad32


def build_qtensor(
    key: str,
    qvalues: torch.Tensor,
    scale_codes: torch.Tensor,
    scale_max: torch.Tensor,
    groups: Sequence[tuple[int, int]],
    invperm: torch.Tensor,
    out_features: int,
    bias: torch.Tensor | None = None,
) -> QTensor:
    """Pack and validate one EXL2 linear.

    qvalues: int [K, Np], stored (activation) row order, values in [0, 2^bits) of each row's group.
    scale_codes: int [G, Np] in 0..15 (the stored code, i.e. qscale - 1).
    scale_max: [G] (converted to fp16).  groups: [(bits, rows)] in storage order, widths non-increasing.
    invperm: [K], original feature i is stored at row invperm[i].  bias: [N] or [Np] or None.
    """
    k, np_ = qvalues.shape
    if np_ != pad32(out_features):
        raise TensorShapeError(f"qvalues has {np_} columns, expected pad32({out_features})", tensor=f"{key}.q_weight")
    if sum(rows for _, rows in groups) != k:
        raise TensorShapeError(f"groups cover {sum(r for _, r in groups)} rows, qvalues has {k}",
                               tensor=f"{key}.q_groups")
    if tuple(scale_codes.shape) != (len(groups), np_):
        raise TensorShapeError(
            f"scale codes shape {tuple(scale_codes.shape)}, expected ({len(groups)}, {np_})", tensor=f"{key}.q_scale"
        )

    packed, q_groups = [], []
    row = qrow = 0
    for bits, rows in groups:
        if rows <= 0 or rows % 32:
            raise UnsupportedBitWidthError(f"group of {rows} rows; rows must be a positive multiple of 32", tensor=key)
        q_groups += [bits, qrow]
        packed.append(pack_columns(qvalues[row : row + rows], bits))  # [rows*bits/32, Np]
        row += rows
        qrow += rows * bits // 32
    if qrow > 32767:  # q_groups offsets are read as signed int16 by the runtime (format doc b.2)
        raise UnsupportedBitWidthError(f"{qrow} packed rows exceed the int16 offset limit", tensor=f"{key}.q_groups")

    if bias is not None:
        bias = bias.detach().to(torch.float16).flatten()
        if bias.numel() == out_features and out_features != np_:
            bias = torch.cat([bias, bias.new_zeros(np_ - out_features)])  # padded columns get no bias

    qt = QTensor(
        key=key,
        q_weight=torch.cat(packed, dim=0),  # int32 [sum qrows, Np]
        q_scale=pack_scales(scale_codes),  # int32 [G, Np/8]
        q_scale_max=scale_max.detach().to(torch.float16).flatten().clone(),  # fp16 [G]
        q_groups=torch.tensor(q_groups, dtype=torch.int16),  # int16 [2G]
        q_invperm=invperm.detach().to(torch.int32).flatten().clone(),  # int32 [K]
        out_features=out_features,
        bias=bias,
    )
    qt.validate(in_features=k)
    return qt
