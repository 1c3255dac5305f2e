"""exl2_dequant against an independent scalar decoder written from format doc b.6 (numpy float16 steps)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from exl2_backend.format.packing import pack_columns, pack_scales
from exl2_backend.format.qtensor import QTensor, pad32
from exl2_backend.ops import reference
from tests.helpers.tolerances import assert_exact


def make_qtensor(groups, n, *, seed=0, scale_max=None, permute=True, bias=False, key="t") -> QTensor:
    """Random QTensor with layout groups = [(bits, rows), ...] (stored order) and N = n."""
    gen = torch.Generator().manual_seed(seed)
    np_ = pad32(n)
    k = sum(r for _, r in groups)
    packed, q_groups, qrow = [], [], 0
    for bits, rows in groups:
        vals = torch.randint(0, 1 << bits, (rows, np_), generator=gen)
        vals[:, n:] = 1 << (bits - 1)  # padding columns hold the zero point, as the converter writes them
        packed.append(pack_columns(vals, bits))
        q_groups += [bits, qrow]
        qrow += rows * bits // 32
    codes = torch.randint(0, 16, (len(groups), np_), generator=gen)
    if scale_max is None:
        scale_max = torch.rand(len(groups), generator=gen) * 0.1 + 1e-3
    invperm = torch.randperm(k, generator=gen) if permute else torch.arange(k)
    return QTensor(
        key=key,
        q_weight=torch.cat(packed),
        q_scale=pack_scales(codes),
        q_scale_max=torch.as_tensor(scale_max).to(torch.float16),
        q_groups=torch.tensor(q_groups, dtype=torch.int16),
        q_invperm=invperm.to(torch.int32),
        out_features=n,
        bias=(torch.randn(np_, generator=gen) * 0.1).half() if bias else None,
    )


def scalar_decode(qt: QTensor) -> np.ndarray:
    """Per element, straight from b.6: stored row, group lookup in q_groups, bit stream walk, fp16 steps."""
    words = qt.q_weight.numpy().astype(np.int64) & 0xFFFFFFFF  # [qrows, Np] as unsigned
    qs = qt.q_scale.numpy().astype(np.int64) & 0xFFFFFFFF
    qg = qt.q_groups.numpy().astype(np.int64)
    bits_g, off_g = qg[0::2], qg[1::2]
    ends = list(off_g[1:]) + [words.shape[0]]
    first_row = np.concatenate([[0], np.cumsum([(e - o) * 32 // b for o, e, b in zip(off_g, ends, bits_g)])])
    invperm = qt.q_invperm.numpy()
    k, np_ = invperm.shape[0], words.shape[1]
    out = np.zeros((k, np_), dtype=np.float16)
    for i in range(k):
        row = int(invperm[i])
        g = int(np.searchsorted(first_row, row, side="right") - 1)
        b, r = int(bits_g[g]), row - int(first_row[g])
        for col in range(np_):
            q = 0
            for j in range(b):  # stream bit r*b + j is bit (pos % 32) of packed row off + pos // 32
                pos = r * b + j
                q |= ((int(words[off_g[g] + pos // 32, col]) >> (pos % 32)) & 1) << j
            c = (int(qs[g, col // 8]) >> (4 * (col % 8))) & 15
            max16 = np.float16(qt.q_scale_max[g].item()) * np.float16(1.0 / 256)
            scale = np.float16((c + 1) ** 2) * max16
            out[i, col] = np.float16(q - (1 << (b - 1))) * scale
    return out


LAYOUTS = {
    "8bit": [(8, 64)],
    "6bit": [(6, 64)],
    "5bit": [(5, 64)],
    "4bit": [(4, 64)],
    "3bit": [(3, 64)],
    "2bit": [(2, 64)],
    "mixed": [(8, 32), (6, 64), (4, 128), (2, 32)],
    "all_widths": [(8, 32), (6, 32), (5, 32), (4, 64), (4, 32), (3, 32), (2, 64)],
}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_dequant_matches_scalar_decoder(name):
    qt = make_qtensor(LAYOUTS[name], n=40, seed=list(LAYOUTS).index(name))
    qt.validate()
    got = reference.exl2_dequant(qt)
    assert got.shape == (qt.in_features, 64) and got.dtype == torch.float16
    assert_exact(got, torch.from_numpy(scalar_decode(qt)), msg=name)


def test_dequant_subnormal_scale_max():
    # q_scale_max / 256 is subnormal in fp16 below 2^-6; products may land in the subnormal range too
    groups = [(8, 32), (6, 32), (4, 32), (2, 32)]
    qt = make_qtensor(groups, n=32, seed=3, scale_max=[2.0**-7, 0.003, 1e-4, 2.0**-6 * 0.999])
    max16 = (qt.q_scale_max.float() / 256).half()
    assert (max16.abs() < 2.0**-14).all() and (max16 > 0).all()  # really subnormal
    assert_exact(reference.exl2_dequant(qt), torch.from_numpy(scalar_decode(qt)))


def test_dequant_large_and_identity_permutation():
    qt = make_qtensor([(4, 64), (3, 64)], n=33, seed=5, scale_max=[3.0, 40.0], permute=False)
    assert_exact(reference.exl2_dequant(qt), torch.from_numpy(scalar_decode(qt)))


def test_dequant_padding_columns_are_zero():
    qt = make_qtensor([(5, 32), (2, 32)], n=10, seed=6)
    assert (reference.exl2_dequant(qt)[:, 10:] == 0).all()


def test_dequant_chunked_unpack(monkeypatch):
    qt = make_qtensor([(8, 96), (3, 128), (2, 64)], n=70, seed=7)
    whole = reference.exl2_dequant(qt)
    monkeypatch.setattr(reference, "_UNPACK_CHUNK_WORDS", 1)  # one 32-row unit per unpack call
    assert_exact(reference.exl2_dequant(qt), whole)


def test_dequant_dispatch_cpu_is_reference():
    from exl2_backend import ops

    qt = make_qtensor(LAYOUTS["mixed"], n=64, seed=8)
    assert_exact(ops.exl2_dequant(qt), reference.exl2_dequant(qt))
