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


_P_ON_DEVICE: dict[str, torch.Tensor] = {}


def _p_grid(device: torch.device) -> torch.Tensor:
    """P_GRID on `device`, copied once (a per-call copy would be a host-device sync on the GPU)."""
    key = str(device)
    if key not in _P_ON_DEVICE:
        _P_ON_DEVICE[key] = P_GRID.to(device)
    return _P_ON_DEVICE[key]


def stretch_errors_reference(r: torch.Tensor, f: torch.Tensor, p_grid: torch.Tensor, bits: int,
                             norm: float = NORM) -> torch.Tensor:
    """Exact search objective: r [rows, N] (weights in units of their column scale), f [N] column weights ->
    float64 [P] sums of f * |clamp(round(r / p), -z, maxq - z) * p - r|^norm (triton_kernels' reference)."""
    z, maxq = 1 << (bits - 1), (1 << bits) - 1
    out = []
    for p in p_grid.to(r.device):
        e = (torch.clamp(torch.round(r / p), -z, maxq - z) * p - r).abs_().pow_(norm)  # [rows, N]
        out.append((e * f).double().sum())
    return torch.stack(out)


def _binned_errors(r: torch.Tensor, f: torch.Tensor, p_grid: torch.Tensor, bits: int,
                   bins_per_step: int = 32) -> torch.Tensor:
    """The objective evaluated on (r, f) pairs collapsed into bins 1/bins_per_step of a step wide.

    It is smooth in r between rounding boundaries, so the f-weighted bin means pick a stretch within 0.05% of
    the exact optimum (measured over all widths; 16 bins per step: 0.7%) at P x bins instead of P x elements
    of work (a 49152-column head group has 6M elements). The bin range is
    fixed per width: |r| <= (maxq/2) * max(base/s) = (maxq/2) * 1.5^2 (the code rounding of a column's scale
    shrinks it by at most (1/1.5)^2), so no size depends on the data and nothing waits for the device.
    """
    z, maxq = 1 << (bits - 1), (1 << bits) - 1
    lim = 1.125 * maxq + 1.0
    nb = int(2 * lim * bins_per_step)
    r, w = r.flatten(), f.expand(r.shape).flatten()
    idx = ((r + lim) * (nb / (2 * lim))).to(torch.int64).clamp_(0, nb - 1)
    wsum = torch.zeros(nb, device=r.device).index_add_(0, idx, w)
    rsum = torch.zeros(nb, device=r.device).index_add_(0, idx, w * r)
    rep = rsum / wsum.clamp_min(1e-30)  # empty bins: weight 0, contribute nothing
    p = p_grid.unsqueeze(1)  # [P, 1]
    e = (torch.clamp(torch.round(rep / p), -z, maxq - z) * p - rep).abs_()  # [P, bins]
    e = e.pow(3).mul_(e.sqrt_()) if NORM == 3.5 else e.pow_(NORM)  # |e|^3.5 as e^3 sqrt(e): cheaper than pow
    return (e @ wsum).double()  # [P]; fp32 sums over <= 37k bins


def search_group_scales(w: torch.Tensor, bits: int, check_finite: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """w: fp32 [rows, N] (one group, unpadded columns) -> (codes int32 [N] in 0..15, q_scale_max fp16 scalar).

    Runs on w's device without a host sync when check_finite is False (the caller then checks the fp16
    maxima for overflow once per tensor). On a GPU with triton the stretch objective is exact; elsewhere binned.
    """
    maxq = (1 << bits) - 1
    base = (w.abs().amax(dim=0) + 1e-12) / (maxq / 2)  # [Np]
    smax = base.max()
    qs = torch.clamp(torch.round(16 * torch.sqrt(base / smax)), 1, 16)  # [Np]
    s = (qs / 16) ** 2 * smax  # [Np] candidate scale before the stretch
    r = w / s  # [rows, Np] weights in units of their column's scale
    f = (s / smax) ** NORM  # [Np]: |s e|^3.5 = s^3.5 |e|^3.5; /smax avoids underflow
    grid = _p_grid(w.device)
    from exl2_backend.quant import triton_kernels

    if triton_kernels.available(w.device):
        err = triton_kernels.stretch_errors(r, f, grid, bits, NORM)
    else:
        err = _binned_errors(r, f, grid, bits)
    q_scale_max = (smax * grid[torch.argmin(err)]).to(torch.float16)
    if check_finite and not torch.isfinite(q_scale_max):
        raise NonFiniteScaleError(f"group maximum {float(smax) * float(grid[torch.argmin(err)]):.3g} overflows fp16")
    return (qs - 1).to(torch.int32), q_scale_max


def quantize_rtn(
    key: str,
    weight: torch.Tensor,
    option: QuantOption,
    perm: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
) -> QTensor:
    """Quantize an HF-layout weight [N, K] with `option` (on weight's device; the QTensor comes back on the CPU).
    perm [K]: stored row k holds original feature perm[k]."""
    n, k = weight.shape
    dev = weight.device
    if not torch.isfinite(weight).all():
        raise ModelFormatError("weight holds NaN or infinite values; cannot quantize", tensor=f"{key}.weight")
    np_ = pad32(n)
    w = torch.zeros(k, np_, dtype=torch.float32, device=dev)  # [K, Np] EXL2 layout (transposed), padding zero
    w[:, :n] = weight.detach().float().t()
    perm = torch.arange(k) if perm is None else perm.detach().cpu()
    perm = perm.long().flatten()
    if perm.numel() != k or not torch.equal(torch.sort(perm).values, torch.arange(k)):
        raise ValueError(f"{key}: perm must be a permutation of 0..{k - 1}")
    w = w[perm.to(dev)]  # stored (activation) order
    groups = option.group_layout(k)

    qvalues = torch.empty(k, np_, dtype=torch.int32, device=dev)  # [K, Np]
    codes = torch.zeros(len(groups), np_, dtype=torch.int32, device=dev)  # [G, Np]; padding columns: code 0
    smax = torch.empty(len(groups), dtype=torch.float16, device=dev)  # [G]
    row = 0
    for g, (bits, rows) in enumerate(groups):
        wg = w[row : row + rows]  # [rows, Np]
        c, m = search_group_scales(wg[:, :n], bits, check_finite=False)
        codes[g, :n] = c
        smax[g] = m
        scale = runtime_scales(m.unsqueeze(0), codes[g : g + 1]).float()  # [1, Np]
        z = 1 << (bits - 1)
        q = torch.where(scale > 0, torch.round(wg / scale), torch.zeros_like(wg)) + z  # all-zero group: scale 0
        q = torch.clamp(q, 0, (1 << bits) - 1)
        q[:, n:] = z  # padding columns decode to exactly 0
        qvalues[row : row + rows] = q.to(torch.int32)
        row += rows
    check_scale_maxima(key, smax)
    invperm = torch.argsort(perm).to(torch.int32)
    return build_qtensor(key, qvalues.cpu(), codes.cpu(), smax.cpu(), groups, invperm, n,
                         bias=None if bias is None else bias.detach().cpu())


def check_scale_maxima(key: str, smax: torch.Tensor) -> None:
    """One check per tensor (one host sync on a GPU): every group's fp16 q_scale_max must be finite."""
    bad = ~torch.isfinite(smax)
    if bool(bad.any()):
        g = int(bad.nonzero()[0, 0])
        raise NonFiniteScaleError(f"group {g}: the scale maximum overflows fp16 (weights too large for EXL2's "
                                  "fp16 scales)", tensor=f"{key}.q_scale_max")
