"""The tensors of one EXL2-quantized linear layer, exactly as stored on disk, and their group layout.

Every layer above this (reference ops, CUDA preparation, the model, the converter) takes a `QTensor`.
EXL2 stores matrices transposed relative to HF: rows run over the K input features (in activation order),
columns over the N output features padded to a multiple of 32 (Np).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from exl2_backend.errors import NonFiniteScaleError, TensorShapeError, UnsupportedBitWidthError

BIT_WIDTHS = (8, 6, 5, 4, 3, 2)  # the only widths, in the order groups must appear


def pad32(n: int) -> int:
    return (n + 31) // 32 * 32


def rows_in_input_order(q_invperm: torch.Tensor) -> bool:
    """Whether an invperm is the identity: stored row k holds input feature k (no act-order permutation)."""
    return torch.equal(q_invperm.cpu(), torch.arange(q_invperm.numel(), dtype=q_invperm.dtype))


@dataclass(frozen=True)
class Group:
    """One quantization group: `rows` stored rows starting at stored row `row_start`, packed at `bits`."""

    bits: int
    rows: int
    row_start: int  # first stored (activation-order) row of the group
    qrow_start: int  # first packed row in q_weight


@dataclass
class QTensor:
    """On-disk tensors of one EXL2 linear. Shapes: K = in_features, Np = pad32(out_features), G groups."""

    key: str  # e.g. "model.layers.0.self_attn.q_proj"
    q_weight: torch.Tensor  # int32 [sum(rows_g * bits_g / 32), Np]
    q_scale: torch.Tensor  # int32 [G, Np / 8], 4-bit codes (c - 1 stored), 8 columns per word
    q_scale_max: torch.Tensor  # fp16 [G]
    q_groups: torch.Tensor  # int16 [2G]: (bits_g, qrow offset_g)
    q_invperm: torch.Tensor  # int32 [K]: original feature i is stored at row q_invperm[i]
    out_features: int  # N, unpadded
    bias: torch.Tensor | None = None  # fp16 [Np]
    source: str | None = None  # file the tensors came from, for error messages
    _groups: list[Group] | None = field(default=None, repr=False, compare=False)

    @property
    def padded_out_features(self) -> int:
        return int(self.q_weight.shape[1])

    @property
    def in_features(self) -> int:
        return int(self.q_invperm.numel())

    @property
    def groups(self) -> list[Group]:
        if self._groups is None:
            self._groups = parse_groups(self.q_groups, int(self.q_weight.shape[0]), key=self.key, path=self.source)
        return self._groups

    @property
    def q_perm(self) -> torch.Tensor:
        """Stored row k holds original feature q_perm[k] (the loader's argsort(q_invperm))."""
        return torch.argsort(self.q_invperm.long()).to(torch.int32)

    def bits_per_weight(self) -> float:
        """bpw as ExLlamaV2 counts it (qparams.total_bits / (K*N)), using the padded width."""
        k, np_ = self.in_features, self.padded_out_features
        g = len(self.groups)
        bits = sum(gr.rows * np_ * gr.bits for gr in self.groups) + g * 16 + g * 32 + g * np_ * 4 + k * 32
        if self.bias is not None:
            bits += 16 * np_
        return bits / (k * np_)

    def to(self, device) -> QTensor:
        """The same tensors on `device` (self when they are there already); the parsed group layout is kept."""
        device = torch.device(device)
        if self.q_weight.device == device:
            return self
        names = ("q_weight", "q_scale", "q_scale_max", "q_groups", "q_invperm")
        moved = {k: getattr(self, k).to(device) for k in names}
        return QTensor(key=self.key, out_features=self.out_features, source=self.source,
                       bias=None if self.bias is None else self.bias.to(device), _groups=self._groups, **moved)

    def storage_bytes(self) -> int:
        tensors = [self.q_weight, self.q_scale, self.q_scale_max, self.q_groups, self.q_invperm]
        if self.bias is not None:
            tensors.append(self.bias)
        return sum(t.numel() * t.element_size() for t in tensors)

    def validate(self, *, in_features: int | None = None) -> None:
        """Check dtypes, shapes, group layout and scale finiteness; raise a typed error naming the tensor."""
        validate_qtensor(self, in_features=in_features)


def parse_groups(q_groups: torch.Tensor, qrows_total: int, *, key: str = "?", path: str | None = None) -> list[Group]:
    """Expand q_groups [2G] into Groups; enforce the format's rules (widths, order, 32-row units)."""
    name = f"{key}.q_groups"
    flat = q_groups.to(torch.int64).flatten().tolist()
    if len(flat) == 0 or len(flat) % 2:
        raise TensorShapeError(f"q_groups must hold 2*G entries, got {len(flat)}", path=path, tensor=name)
    bits = flat[0::2]
    offsets = flat[1::2]
    groups: list[Group] = []
    row = 0
    seen_order: list[int] = []
    for g, (b, off) in enumerate(zip(bits, offsets)):
        if b not in BIT_WIDTHS:
            raise UnsupportedBitWidthError(
                f"group {g} has bit width {b}; EXL2 allows only {sorted(BIT_WIDTHS)}", path=path, tensor=name
            )
        if seen_order and b != seen_order[-1] and b in seen_order:
            raise UnsupportedBitWidthError(
                f"group {g}: bit width {b} appears in two separate runs; widths must form contiguous runs",
                path=path, tensor=name,
            )
        if seen_order and b > seen_order[-1]:
            raise UnsupportedBitWidthError(
                f"group {g}: bit width {b} after {seen_order[-1]}; widths must be non-increasing", path=path,
                tensor=name)
        if not seen_order or seen_order[-1] != b:
            seen_order.append(b)
        end = offsets[g + 1] if g + 1 < len(offsets) else qrows_total
        qrows = end - off
        if g == 0 and off != 0:
            raise UnsupportedBitWidthError(f"first group starts at packed row {off}, not 0", path=path, tensor=name)
        if qrows <= 0 or (qrows * 32) % b:
            raise UnsupportedBitWidthError(
                f"group {g} spans {qrows} packed rows, not a whole number of {b}-bit rows", path=path, tensor=name
            )
        rows = qrows * 32 // b
        if rows % 32:
            raise UnsupportedBitWidthError(
                f"group {g} has {rows} rows; every group's rows must be a multiple of 32", path=path, tensor=name
            )
        groups.append(Group(bits=b, rows=rows, row_start=row, qrow_start=off))
        row += rows
    return groups


def validate_qtensor(qt: QTensor, *, in_features: int | None = None) -> None:
    path, key = qt.source, qt.key
    expect = {
        "q_weight": torch.int32,
        "q_scale": torch.int32,
        "q_scale_max": torch.float16,
        "q_groups": torch.int16,
    }
    for name, dtype in expect.items():
        t = getattr(qt, name)
        if t.dtype != dtype:
            raise TensorShapeError(f"dtype {t.dtype}, expected {dtype}", path=path, tensor=f"{key}.{name}")
    if qt.q_invperm.dtype not in (torch.int32, torch.int16):
        raise TensorShapeError(
            f"dtype {qt.q_invperm.dtype}, expected int32 or int16", path=path, tensor=f"{key}.q_invperm"
        )
    if qt.q_weight.dim() != 2:
        raise TensorShapeError(f"shape {tuple(qt.q_weight.shape)} is not 2-D", path=path, tensor=f"{key}.q_weight")
    np_ = qt.padded_out_features
    if np_ % 32 or np_ != pad32(qt.out_features):
        raise TensorShapeError(
            f"q_weight has {np_} columns; expected pad32(out_features={qt.out_features}) = {pad32(qt.out_features)}",
            path=path, tensor=f"{key}.q_weight",
        )
    groups = qt.groups
    g = len(groups)
    if tuple(qt.q_scale.shape) != (g, np_ // 8):
        raise TensorShapeError(
            f"shape {tuple(qt.q_scale.shape)}, expected ({g}, {np_ // 8})", path=path, tensor=f"{key}.q_scale"
        )
    if tuple(qt.q_scale_max.shape) != (g,):
        raise TensorShapeError(
            f"shape {tuple(qt.q_scale_max.shape)}, expected ({g},)", path=path, tensor=f"{key}.q_scale_max"
        )
    k = sum(gr.rows for gr in groups)
    if qt.q_invperm.dim() != 1 or qt.q_invperm.numel() != k:
        raise TensorShapeError(
            f"shape {tuple(qt.q_invperm.shape)}, expected ({k},) from the group layout",
            path=path, tensor=f"{key}.q_invperm",
        )
    if in_features is not None and k != in_features:
        raise TensorShapeError(
            f"groups cover {k} input rows but the layer has in_features={in_features}",
            path=path, tensor=f"{key}.q_groups",
        )
    if not torch.isfinite(qt.q_scale_max).all():
        raise NonFiniteScaleError("q_scale_max holds NaN or infinite values", path=path, tensor=f"{key}.q_scale_max")
    smax = qt.q_scale_max.float()
    if (smax < 0).any():  # the format stores fp16(max |scale|): a sign would flip the group's weights silently
        raise NonFiniteScaleError(f"q_scale_max holds a negative value ({smax.min().item():g})", path=path,
                                  tensor=f"{key}.q_scale_max")
    # |w| <= q_scale_max * 2^(bits-1) (scale code 15, code 0): past fp16's range the weights dequantize to inf
    reach = smax * torch.tensor([float(1 << (gr.bits - 1)) for gr in groups], device=smax.device)
    if (reach > 65504.0).any():
        g_bad = int(torch.argmax(reach))
        raise NonFiniteScaleError(
            f"group {g_bad}: q_scale_max {smax[g_bad].item():g} with {groups[g_bad].bits}-bit codes reaches "
            f"|w| = {reach[g_bad].item():g}, past fp16's 65504", path=path, tensor=f"{key}.q_scale_max")
    inv = qt.q_invperm.long()
    if inv.numel() and (inv.min() < 0 or inv.max() >= k or torch.unique(inv).numel() != k):
        raise TensorShapeError("is not a permutation of 0..K-1", path=path, tensor=f"{key}.q_invperm")
    if qt.bias is not None and (qt.bias.dim() != 1 or qt.bias.numel() != np_ or qt.bias.dtype != torch.float16):
        raise TensorShapeError(
            f"shape {tuple(qt.bias.shape)} dtype {qt.bias.dtype}, expected fp16 ({np_},)", path=path,
            tensor=f"{key}.bias")
