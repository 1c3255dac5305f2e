"""Round-to-nearest EXL2 quantization with ExLlamaV2's per-group scale search (format doc d.5), no GPTQ.

Per group: per column base = (max|w| + 1e-12) / (maxq/2); smax = max(base); 4-bit code
qs = clamp(round(16 sqrt(base/smax)), 1, 16); a global stretch p from a 97-point grid in [0.70, 1.20]
minimizing sum |err|^3.5; q_scale_max = fp16(smax p). Values are then rounded with the FP16 scale exactly
as the runtime rebuilds it (format doc b.4/b.6), so the stored codes decode to the nearest grid points.
"""

from __future__ import annotations

import torch

from exl2_backend.errors import ModelFormatError, NonFiniteScaleError
from exl2_backend.format.build import build_qtensor
from exl2_backend.format.layout import QuantOption
from exl2_backend.format.qtensor import QTensor, pad32

P_GRID = torch.linspace(0.70, 1.20, 97)  # candidate stretches of the group maximum
NORM = 3.5  # error exponent of the search


def runtime_scales(q_scale_max: torch.Tensor, codes: torch.Tensor) -> torch.Tensor:
    """fp16 scales the runtime uses: fp16(fp16((c+1)^2) * fp16(q_scale_max / 256)). [G], [G, Np] -> [G, Np]."""
    max16 = (q_scale_max.to(torch.float16).float() / 256).half()  # may be subnormal; rounding matches __hmul
    sq = ((codes.long() + 1) ** 2).to(torch.float16)
    return (sq.float() * max16.float().unsqueeze(-1)).half()


def _bin_weighted(r: torch.Tensor, f: torch.Tensor, bins_per_step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Collapse (r, weight f) pairs into bins 1/bins_per_step of a quantization step wide.

    Returns the f-weighted mean r of each non-empty bin and the bin's total weight. The objective is smooth
    in r between rounding boundaries, so evaluating it at bin means is accurate to well under 1% while
    costing 97 x bins instead of 97 x elements (a 49152-column head group has 6M elements).
    """
    lim = float(r.abs().max()) + 1e-6
    nb = int(min(max(2 * lim * bins_per_step, 64), 1 << 16))
    idx = ((r + lim) * (nb / (2 * lim))).to(torch.int32).clamp_(0, nb - 1)
    wsum = torch.zeros(nb).index_add_(0, idx, f)
    rsum = torch.zeros(nb).index_add_(0, idx, f * r)
    keep = wsum > 0
    return rsum[keep] / wsum[keep], wsum[keep]


def search_group_scales(w: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """w: fp32 [rows, N] (one group, unpadded columns) -> (codes int32 [N] in 0..15, q_scale_max fp16 scalar)."""
    maxq = (1 << bits) - 1
    z = 1 << (bits - 1)
    base = (w.abs().amax(dim=0) + 1e-12) / (maxq / 2)  # [Np]
    smax = base.max()
    qs = torch.clamp(torch.round(16 * torch.sqrt(base / smax)), 1, 16)  # [Np]
    s = (qs / 16) ** 2 * smax  # [Np] candidate scale before the stretch

    r = (w / s).flatten()  # [rows*Np] weights in units of their column's scale
    f = ((s / smax) ** NORM).expand_as(w).flatten()  # |s e|^3.5 = s^3.5 |e|^3.5; /smax avoids underflow
    rep, wt = _bin_weighted(r, f, bins_per_step=64)
    p = P_GRID.unsqueeze(1)  # [P, 1]
    e = (torch.clamp(torch.round(rep / p), -z, maxq - z) * p - rep).abs_().pow_(NORM)  # [P, bins]
    err = e.double() @ wt.double()  # [P]
    p_best = P_GRID[int(torch.argmin(err))]
    q_scale_max = (smax * p_best).to(torch.float16)
    if not torch.isfinite(q_scale_max):
        raise NonFiniteScaleError(f"group maximum {float(smax * p_best):.3g} overflows fp16")
    return (qs - 1).to(torch.int32), q_scale_max


def quantize_rtn(
    key: str,
    weight: torch.Tensor,
    option: QuantOption,
    perm: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
) -> QTensor:
    """Quantize an HF-layout weight [N, K] with `option`. perm [K]: stored row k holds original feature perm[k]."""
    n, k = weight.shape
    if not torch.isfinite(weight).all():
        raise ModelFormatError("weight holds NaN or infinite values; cannot quantize", tensor=f"{key}.weight")
    np_ = pad32(n)
    w = torch.zeros(k, np_, dtype=torch.float32)  # [K, Np] EXL2 layout (transposed), padding columns zero
    w[:, :n] = weight.detach().float().t()
    if perm is None:
        perm = torch.arange(k)
    perm = perm.long().flatten()
    if perm.numel() != k or not torch.equal(torch.sort(perm).values, torch.arange(k)):
        raise ValueError(f"{key}: perm must be a permutation of 0..{k - 1}")
    w = w[perm]  # stored (activation) order
    groups = option.group_layout(k)

    qvalues = torch.empty(k, np_, dtype=torch.int32)  # [K, Np]
    codes = torch.empty(len(groups), np_, dtype=torch.int32)  # [G, Np]
    smax = torch.empty(len(groups), dtype=torch.float16)  # [G]
    row = 0
    for g, (bits, rows) in enumerate(groups):
        wg = w[row : row + rows]  # [rows, Np]
        try:
            c, m = search_group_scales(wg[:, :n], bits)
        except NonFiniteScaleError as e:
            raise NonFiniteScaleError(f"group {g}: {e}", tensor=f"{key}.q_scale_max") from None
        codes[g, :n], codes[g, n:] = c, 0  # padding columns: code 0 (converter convention)
        smax[g] = m
        scale = runtime_scales(m.unsqueeze(0), codes[g : g + 1]).float()  # [1, Np]
        z = 1 << (bits - 1)
        q = torch.where(scale > 0, torch.round(wg / scale), torch.zeros_like(wg)) + z  # all-zero group: scale 0
        q = torch.clamp(q, 0, (1 << bits) - 1)
        q[:, n:] = z  # padding columns decode to exactly 0
        qvalues[row : row + rows] = q.to(torch.int32)
        row += rows
    invperm = torch.argsort(perm).to(torch.int32)
    return build_qtensor(key, qvalues, codes, smax, groups, invperm, n, bias=bias)
