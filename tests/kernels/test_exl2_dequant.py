"""exl2_dequant (CUDA) bit-exact against the reference, plus a CPU check of the kernel layout: a numpy
transliteration of the kernel's per-lane decode (exl2_quant.cuh pair_qz, fp16 mantissa trick and all) run on
`pack_qtensor`'s output must reproduce the reference dequantization exactly."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from exl2_backend.format.build import build_qtensor
from exl2_backend.format.packing import unpack_scales
from exl2_backend.format.qtensor import QTensor, pad32
from exl2_backend.ops import reference
from exl2_backend.ops.cuda_quant import PackedQ, pack_qtensor
from tests.helpers.tolerances import assert_exact

ALL_WIDTHS = [(8, 32), (8, 32), (6, 64), (6, 128), (5, 128), (5, 32), (4, 128), (4, 64), (3, 32), (3, 128), (2, 96)]


def make_qt(groups, n, *, seed=0, scale_max=None, bias=False, key="t") -> QTensor:
    """Random QTensor with stored-order layout groups [(bits, rows)], N = n, random act-order permutation."""
    g = torch.Generator().manual_seed(seed)
    np_, k = pad32(n), sum(r for _, r in groups)
    q = torch.empty(k, np_, dtype=torch.int32)
    row = 0
    for bits, rows in groups:
        q[row : row + rows] = torch.randint(0, 1 << bits, (rows, np_), generator=g, dtype=torch.int32)
        q[row : row + rows, n:] = 1 << (bits - 1)
        row += rows
    codes = torch.randint(0, 16, (len(groups), np_), generator=g, dtype=torch.int32)
    if scale_max is None:
        scale_max = torch.rand(len(groups), generator=g) * 0.045 + 0.005
    b = (torch.randn(n, generator=g) * 0.1).half() if bias else None
    return build_qtensor(key, q, codes, torch.as_tensor(scale_max).half(), groups, torch.randperm(k, generator=g), n,
                         bias=b)


# --- CPU: the layout, decoded the way the kernel decodes it ------------------------------------------------

_U32 = np.uint32


def _h2(v):  # uint32 -> (low half, high half) as float16
    return (v & _U32(0xFFFF)).astype(np.uint16).view(np.float16), (v >> _U32(16)).astype(np.uint16).view(np.float16)


def _from_bits(c):
    return np.uint16(c).view(np.float16)


def _shr(x, s):
    return x >> _U32(s) if s > 0 else (x << _U32(-s) if s < 0 else x)


def _pair_qz(bits: int, p: int, w: list) -> tuple[np.ndarray, np.ndarray]:
    """Literal transliteration of pair_qz<B, P> (w = the lane's words): half2 (q - z) as two float16 arrays."""
    magic = _U32(0x64006400)
    if bits == 8:
        word = w[p // 2]
        byte = [(word >> _U32(8 * i)) & _U32(255) for i in range(4)]
        v = byte[p & 1] | _U32(0x64 << 8) | (byte[2 + (p & 1)] << _U32(16)) | _U32(0x64 << 24)  # __byte_perm
        sub = 0x6480
    elif bits == 4:
        word = w[p >> 2] >> _U32(8) if (p & 3) >= 2 else w[p >> 2]
        if p & 1:
            lo, hi = _h2((word & _U32(0x00F000F0)) | magic)
            f = lambda h: (h * _from_bits(0x2C00) + _from_bits(0xD480)).astype(np.float16)
            return f(lo), f(hi)
        v, sub = (word & _U32(0x000F000F)) | magic, 0x6408
    elif bits == 2:
        o = 2 * (p & 3)
        word = w[p >> 3] >> _U32(8) if (p & 7) >= 4 else w[p >> 3]
        v = (word & _U32(0x00030003 << o)) | magic
        if o:
            mul, add = {2: (0x3400, 0xDC08), 4: (0x2C00, 0xD420), 6: (0x2400, 0xCC80)}[o]
            return tuple((h * _from_bits(mul) + _from_bits(add)).astype(np.float16) for h in _h2(v))
        sub = 0x6402
    elif bits == 6:
        lo = ((w[p >> 2] >> _U32(4 * (p & 3))) & _U32(0x000F000F)) | magic
        v, sub = lo | (_shr(w[4 + (p >> 3)], 2 * (p & 7) - 4) & _U32(0x00300030)), 0x6420
    elif bits == 5:
        lo = ((w[p >> 2] >> _U32(4 * (p & 3))) & _U32(0x000F000F)) | magic
        v, sub = lo | (_shr(w[4], p - 4) & _U32(0x00100010)), 0x6410
    elif p == 15:  # 3-bit: bit k of pair 15 is bit 15 of word k, moved to bit 5 + k
        v = ((w[0] >> _U32(10)) & _U32(0x00200020)) | magic
        v = ((w[1] >> _U32(9)) & _U32(0x00400040)) | v
        v = ((w[2] >> _U32(8)) & _U32(0x00800080)) | v
        return tuple((h * _from_bits(0x2800) + _from_bits(0xD080)).astype(np.float16) for h in _h2(v))
    else:  # 3-bit: pair p whole at offset 3 (p % 5) of word p // 5; offsets 9 and 12 read the word shifted by 8
        o = 3 * (p % 5)
        word, o = (w[p // 5], o) if o <= 6 else (w[p // 5] >> _U32(8), o - 8)
        v = (word & _U32(0x00070007 << o)) | magic
        if o:
            mul, add = {1: (0x3800, 0xE008), 3: (0x3000, 0xD820), 4: (0x2C00, 0xD440), 6: (0x2400, 0xCD00)}[o]
            return tuple((h * _from_bits(mul) + _from_bits(add)).astype(np.float16) for h in _h2(v))
        sub = 0x6404
    lo, hi = _h2(v)
    return (lo - _from_bits(sub)).astype(np.float16), (hi - _from_bits(sub)).astype(np.float16)


def emulate_qz(pq: PackedQ) -> np.ndarray:
    """float16 [Kpad, Np]: (q - z) of every padded stored row, following the kernels' addressing and decode."""
    words = pq.packed.cpu().numpy().view(np.uint32)
    J = pq.Np // 32
    out = np.full((pq.Kpad, pq.Np), np.nan, dtype=np.float16)
    nt = np.arange(2).reshape(2, 1)
    lane = np.arange(32).reshape(1, 32)
    for bits, cs, ce, base in pq.runs:
        m = 8 if bits == 8 else (4 if bits >= 4 else 2)
        for c in range(cs, ce):
            tile = words[base + (c - cs) * J * 64 * bits : base + (c - cs + 1) * J * 64 * bits].reshape(J, 64 * bits)
            main = tile[:, : 64 * m].reshape(J, 2, 32, m)
            aux = tile[:, 64 * m :].reshape(J, 2, 32, bits - m)
            w = [main[..., i] for i in range(m)] + [aux[..., i] for i in range(bits - m)]  # each [J, 2, 32]
            for p in range(16):
                s, r = p // 4, p % 4
                row = 32 * (s // 2) + 8 * (lane % 4) + 4 * (s % 2) + 2 * (r // 2)  # [1, 32]
                col = np.arange(J).reshape(J, 1, 1) * 32 + 16 * nt + lane // 4 + 8 * (r % 2)  # [J, 2, 32]
                for half, qz in enumerate(_pair_qz(bits, p, w)):
                    out[np.broadcast_to(c * 64 + row + half, qz.shape), col] = qz
    assert not np.isnan(out).any(), "layout left rows or columns undecoded"
    return out


def unit_scales(pq: PackedQ) -> np.ndarray:
    """float32 [Kpad/32, Np]: the fp16 scale of each 32-row unit's group, from the chunk info."""
    codes = unpack_scales(pq.scales.cpu()).numpy()
    maxf = pq.maxf.cpu().numpy()
    info = pq.info.cpu().numpy().view(np.uint32).astype(np.int64)
    g0 = info & 0x3FFFFFFF
    groups = np.stack([g0, g0 + ((info >> 30) & 1)], axis=1).reshape(-1)  # [units]
    return ((codes[groups] + 1.0) ** 2 * maxf[groups, None]).astype(np.float32).astype(np.float16).astype(np.float32)


def emulate_dequant(pq: PackedQ) -> torch.Tensor:
    """fp16 [K, Np] in original row order, as the dequant kernel computes it."""
    w = (emulate_qz(pq).astype(np.float32) * np.repeat(unit_scales(pq), 32, axis=0)).astype(np.float16)
    xmap = pq.xmap.cpu().numpy().view(np.uint16).astype(np.int64)
    keep = xmap != 0xFFFF
    out = np.zeros((pq.K, pq.Np), dtype=np.float16)
    out[xmap[keep]] = w[keep]
    return torch.from_numpy(out)


@pytest.mark.parametrize(
    "groups,n",
    [
        ([(8, 32), (8, 64)], 64),
        ([(6, 128), (6, 32)], 64),
        ([(5, 128)], 96),
        ([(4, 128), (4, 32)], 100),
        ([(3, 128), (3, 64)], 64),
        ([(2, 32), (2, 128)], 32),
        (ALL_WIDTHS, 160),
    ],
)
def test_layout_decodes_to_reference_cpu(groups, n):
    qt = make_qt(groups, n, seed=len(groups) + n)
    pq = pack_qtensor(qt, "cpu")
    assert pq.Kpad % 64 == 0 and pq.info.numel() == pq.C
    assert_exact(emulate_dequant(pq), reference.exl2_dequant(qt))


# --- CUDA ---------------------------------------------------------------------------------------------------


def _cuda_dequant(qt: QTensor) -> torch.Tensor:
    from exl2_backend.ops import cuda_quant

    return cuda_quant.exl2_dequant(_to_cuda(qt))


def _to_cuda(qt: QTensor) -> QTensor:
    f = {k: getattr(qt, k).cuda() for k in ("q_weight", "q_scale", "q_scale_max", "q_groups", "q_invperm")}
    return QTensor(key=qt.key, out_features=qt.out_features, bias=None if qt.bias is None else qt.bias.cuda(), **f)


@pytest.mark.cuda
@pytest.mark.parametrize("bits", [2, 3, 4, 5, 6, 8])
def test_dequant_each_width(bits):
    qt = make_qt([(bits, 128), (bits, 128), (bits, 32)], 256, seed=bits)
    assert_exact(_cuda_dequant(qt).cpu(), reference.exl2_dequant(qt))


@pytest.mark.cuda
@pytest.mark.parametrize(
    "groups,n",
    [
        (ALL_WIDTHS, 100),  # every width, mixed group sizes, N not a multiple of 32
        ([(4, 64), (2, 32)], 64),  # K = 96
        ([(8, 32), (4, 128)], 200),  # K = 160
        ([(8, 32)] * 3 + [(4, 128)] * 31 + [(4, 64)], 4097),  # K = 4128, Np = 4128
        ([(6, 128)] * 2, 1000),  # 8 column blocks, the last partial
    ],
)
def test_dequant_mixed_layouts(groups, n):
    qt = make_qt(groups, n, seed=n)
    assert_exact(_cuda_dequant(qt).cpu(), reference.exl2_dequant(qt))


@pytest.mark.cuda
def test_dequant_subnormal_scales():
    # max16 = fp16(q_scale_max / 256) is subnormal below 2^-6, and zero below ~2^-17
    groups = [(8, 32), (6, 64), (4, 128), (4, 128), (2, 64)]
    smax = torch.tensor([2.0**-7, 3e-5, 1e-3, 2.0**-20, 6e-4])
    qt = make_qt(groups, 96, seed=7, scale_max=smax)
    assert_exact(_cuda_dequant(qt).cpu(), reference.exl2_dequant(qt))


@pytest.mark.cuda
def test_dequant_real_option_and_dispatch():
    from exl2_backend import ops
    from tests.helpers.synth import random_qtensor

    qt = _to_cuda(random_qtensor("down", 1024, 512, "8:0.05@32 4:0.95@128", seed=3))
    assert_exact(ops.exl2_dequant(qt).cpu(), reference.exl2_dequant(qt).cpu())


@pytest.mark.cuda
def test_dequant_column_slices_and_opcheck():
    from exl2_backend.ops import cuda_quant

    qt = _to_cuda(make_qt([(5, 128), (3, 128)], 1000, seed=11))
    op = cuda_quant.prepare_linear([qt], "cuda")
    p = op.launch.parts[0]
    full = reference.exl2_dequant(qt)
    part = torch.ops.exl2_backend.exl2_dequant(p.packed, op.launch.handle, 0, 256, 800)
    assert_exact(part, full[:, 256:800])
    torch.library.opcheck(torch.ops.exl2_backend.exl2_dequant.default, (p.packed, op.launch.handle, 0, 0, p.Np))
