"""quantize_rtn: decoded weights (local fp16 decoder written from format doc b.6) stay within half a step."""

from __future__ import annotations

import pytest
import torch

from exl2_backend.format.layout import HEAD_OPTIONS, QuantOption
from exl2_backend.format.packing import unpack_columns, unpack_scales
from exl2_backend.format.qtensor import QTensor
from exl2_backend.quant.rtn import NORM, P_GRID, quantize_rtn, search_group_scales


def decode(qt: QTensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(W fp16 [K, Np] in original feature order, scale fp16 [K, Np]) step by step as in format doc b.6."""
    k, np_ = qt.in_features, qt.padded_out_features
    codes = unpack_scales(qt.q_scale)  # [G, Np]
    stored = torch.empty(k, np_, dtype=torch.float16)
    scales = torch.empty(k, np_, dtype=torch.float16)
    for gi, g in enumerate(qt.groups):
        q = unpack_columns(qt.q_weight[g.qrow_start : g.qrow_start + g.rows * g.bits // 32], g.bits)  # [rows, Np]
        max16 = (qt.q_scale_max[gi].float() * (1 / 256)).half()  # fp16(q_scale_max * prescale/256)
        c2 = ((codes[gi] + 1) ** 2).half()  # __int2half_rn((c+1)^2)
        scale = (c2.float() * max16.float()).half()  # __hmul
        qz = (q - (1 << (g.bits - 1))).half()  # fp16(q - z)
        stored[g.row_start : g.row_start + g.rows] = (qz.float() * scale.float()).half()
        scales[g.row_start : g.row_start + g.rows] = scale
    inv = qt.q_invperm.long()  # original feature i lives at stored row inv[i]
    return stored[inv], scales[inv]


def _check_bound(weight: torch.Tensor, qt: QTensor) -> float:
    """Assert |w - dq| <= scale/2 + fp16 rounding for every unclamped value; return the clamped fraction."""
    n, k = weight.shape
    w = weight.float().t()  # [K, N] original order
    dq, scale = decode(qt)
    dq, scale = dq[:, :n].float(), scale[:, :n].float()
    z_of_row = torch.empty(k)
    for g in qt.groups:
        z_of_row[qt.q_perm[g.row_start : g.row_start + g.rows].long()] = 1 << (g.bits - 1)
    z = z_of_row.unsqueeze(1)  # [K, 1]
    ratio = w / scale
    unclamped = (ratio >= -z - 0.5) & (ratio <= z - 0.5)
    err = (w - dq).abs()
    bound = scale / 2 + dq.abs() * 2.0**-11 + 1e-7
    bad = unclamped & (err > bound)
    assert not bad.any(), f"{int(bad.sum())} values beyond half a step, worst excess {float((err - bound)[bad].max())}"
    return 1 - float(unclamped.float().mean())


@pytest.mark.parametrize("option", ["2:1@32", "3:1@64", "4:1@128", "5:1@32", "6:1@64", "8:1@128",
                                    "8:0.05@32 4:0.95@128", "6:0.05@32 3:0.2@64 2:0.75@64", "8:1@32"])
def test_error_within_half_step_every_width(option):
    g = torch.Generator().manual_seed(len(option))
    weight = torch.randn(72, 256, generator=g) * 0.02  # [N, K], N not a multiple of 32
    qt = quantize_rtn("x", weight, QuantOption.parse(option))
    assert qt.out_features == 72 and qt.padded_out_features == 96 and qt.in_features == 256
    assert _check_bound(weight, qt) < 0.05
    dq, _ = decode(qt)
    assert torch.equal(dq[:, 72:], torch.zeros(256, 24, dtype=torch.float16))  # padding decodes to 0
    assert (unpack_scales(qt.q_scale)[:, 72:] == 0).all()


def test_mean_error_shrinks_with_bits():
    g = torch.Generator().manual_seed(0)
    weight = torch.randn(64, 128, generator=g)
    errs = []
    for b in (2, 3, 4, 5, 6, 8):
        dq, _ = decode(quantize_rtn("x", weight, QuantOption.parse(f"{b}:1@32")))
        errs.append(float((dq[:, :64].float() - weight.t()).abs().mean()))
    assert errs == sorted(errs, reverse=True) and errs[-1] < errs[0] / 20


def test_activation_order_perm():
    g = torch.Generator().manual_seed(1)
    weight = torch.randn(64, 192, generator=g)
    weight[:, 5] *= 30  # an outlier feature: act-order would put it first
    perm = torch.randperm(192, generator=g)
    qt = quantize_rtn("x", weight, QuantOption.parse("8:0.1@32 4:0.9@32"), perm=perm)
    assert torch.equal(qt.q_invperm.long(), torch.argsort(perm)) and torch.equal(qt.q_perm.long(), perm)
    _check_bound(weight, qt)
    dq_plain, _ = decode(quantize_rtn("x", weight, QuantOption.parse("4:1@32")))
    dq_perm, _ = decode(quantize_rtn("x", weight, QuantOption.parse("4:1@32"), perm=perm))
    assert dq_perm.shape == dq_plain.shape  # both in original order
    # with the same width everywhere only the grouping differs: errors are of the same size
    e1 = (dq_plain[:, :64].float() - weight.t()).abs().mean()
    e2 = (dq_perm[:, :64].float() - weight.t()).abs().mean()
    assert 0.5 < float(e1 / e2) < 2


def test_bias_and_head_option():
    g = torch.Generator().manual_seed(2)
    weight = torch.randn(300, 128, generator=g) * 0.05
    bias = torch.randn(300, generator=g)
    qt = quantize_rtn("lm_head", weight, HEAD_OPTIONS[6], bias=bias)
    assert qt.bias.shape == (320,) and qt.bias.dtype == torch.float16
    assert torch.equal(qt.bias[:300], bias.half()) and (qt.bias[300:] == 0).all()
    _check_bound(weight, qt)


def test_zero_and_tiny_groups_decode_to_zero():
    weight = torch.zeros(32, 64)
    weight[:, 32:] = 1e-9  # second group (rows 32..63) is tiny, first is exactly 0
    qt = quantize_rtn("x", weight, QuantOption.parse("4:1@32"))
    assert torch.isfinite(qt.q_scale_max).all()
    dq, _ = decode(qt)
    assert torch.isfinite(dq).all() and dq.abs().max() < 1e-6


def test_rejects_bad_inputs():
    from exl2_backend.errors import ModelFormatError

    weight = torch.randn(32, 64)
    with pytest.raises(ValueError):
        quantize_rtn("x", weight, QuantOption.parse("4:1@32"), perm=torch.zeros(64, dtype=torch.long))
    weight[3, 7] = float("nan")
    with pytest.raises(ModelFormatError) as e:
        quantize_rtn("x", weight, QuantOption.parse("4:1@32"))
    assert e.value.tensor == "x.weight"


def _exact_objective(w: torch.Tensor, bits: int, codes: torch.Tensor) -> torch.Tensor:
    """sum |clamp(rint(w / (s p))) s p - w|^3.5 for every p of the grid, on every element (no binning)."""
    maxq, z = (1 << bits) - 1, 1 << (bits - 1)
    base = (w.abs().amax(dim=0) + 1e-12) / (maxq / 2)
    s = ((codes + 1).float() / 16) ** 2 * base.max()
    out = []
    for p in P_GRID:
        q = torch.clamp(torch.round(w / (s * p)), -z, maxq - z)
        out.append(((q * s * p - w).abs().double() ** NORM).sum())
    return torch.stack(out)


@pytest.mark.parametrize("bits", [2, 4, 6, 8])
def test_stretch_search_is_near_the_exact_optimum(bits):
    g = torch.Generator().manual_seed(bits)
    w = torch.randn(64, 200, generator=g) * torch.rand(200, generator=g)  # columns of different ranges
    codes, qsm = search_group_scales(w, bits)
    maxq = (1 << bits) - 1
    smax = float((w.abs().amax(dim=0) + 1e-12).max() / (maxq / 2))
    obj = _exact_objective(w, bits, codes)
    p_chosen = int(torch.argmin((P_GRID * smax - float(qsm)).abs()))  # qsm = fp16(smax p)
    assert float(obj[p_chosen]) <= float(obj.min()) * 1.01
    assert codes.min() >= 0 and codes.max() <= 15 and qsm.dtype == torch.float16


def test_large_head_is_fast_enough():
    import time

    weight = torch.randn(8192, 576) * 0.02  # a slice of a SmolLM2-sized head
    t = time.perf_counter()
    qt = quantize_rtn("lm_head", weight, HEAD_OPTIONS[6])
    assert time.perf_counter() - t < 30  # generous: shared CI CPUs; typically well under a second
    assert qt.in_features == 576 and qt.out_features == 8192
