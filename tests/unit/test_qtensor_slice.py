"""QTensor parts for tensor parallelism: a column subset or a range of whole stored-row groups dequantizes to
exactly the same part of the full dequantization (bit for bit), and row parts add up to the full product."""

from __future__ import annotations

import pytest
import torch

from exl2_backend.errors import TensorShapeError
from exl2_backend.format.qtensor_slice import balanced_group_ranges, select_columns, select_group_rows
from exl2_backend.ops import reference
from tests.helpers.synth import random_qtensor
from tests.helpers.tolerances import assert_exact

# K x N, option: widths 8/6/5/4/3/2 mixed in one tensor, odd N (padding columns), bias
CASES = [(256, 100, "8:0.1@32 4:0.9@64", True), (512, 77, "6:0.25@32 5:0.25@32 3:0.5@64", False),
         (320, 64, "4:1@32", False), (384, 45, "2:1@128", True)]


@pytest.mark.parametrize("k,n,option,bias", CASES)
def test_select_columns_equals_dequant_columns(k, n, option, bias):
    qt = random_qtensor("t", k, n, option, seed=k + n, bias=bias)
    full = reference.exl2_dequant(qt)  # [K, Np]
    cols = torch.randperm(n, generator=torch.Generator().manual_seed(1))[: n // 2 + 3]  # any order, odd count
    part = select_columns(qt, cols)
    part.validate(in_features=k)
    assert part.out_features == cols.numel()
    assert_exact(reference.exl2_dequant(part)[:, : cols.numel()], full[:, cols])
    pad = reference.exl2_dequant(part)[:, cols.numel():]
    assert bool((pad == 0).all()), "padding columns must decode to zero"
    if bias:
        assert_exact(part.bias[: cols.numel()], qt.bias[cols])


@pytest.mark.parametrize("k,n,option,bias", CASES)
@pytest.mark.parametrize("parts", [1, 2, 3])
def test_group_row_parts_sum_to_full_product(k, n, option, bias, parts):
    qt = random_qtensor("t", k, n, option, seed=k * 3 + n, bias=bias)
    if parts > len(qt.groups):
        pytest.skip("fewer groups than parts")
    full = reference.exl2_dequant(qt)  # [K, Np], original row order
    x = torch.randn(3, k, dtype=torch.float64)
    total = torch.zeros(3, qt.padded_out_features, dtype=torch.float64)
    seen = []
    for g0, g1 in balanced_group_ranges(qt, parts):
        part, feats = select_group_rows(qt, g0, g1)
        part.validate(in_features=feats.numel())
        assert_exact(reference.exl2_dequant(part), full[feats])  # local row j = original feature feats[j]
        total += x[:, feats] @ full[feats].double()
        seen.append(feats)
    assert sorted(torch.cat(seen).tolist()) == list(range(k)), "every input feature in exactly one part"
    torch.testing.assert_close(total, x @ full.double(), rtol=1e-12, atol=1e-12)


def test_balanced_ranges_are_balanced_and_cover_all_groups():
    qt = random_qtensor("t", 1024, 32, "8:0.05@32 4:0.95@64", seed=3)
    ranges = balanced_group_ranges(qt, 2)
    assert ranges[0][0] == 0 and ranges[-1][1] == len(qt.groups) and ranges[0][1] == ranges[1][0]
    rows = [sum(g.rows for g in qt.groups[a:b]) for a, b in ranges]
    assert abs(rows[0] - rows[1]) <= 64


def test_bad_selections_raise():
    qt = random_qtensor("t", 64, 40, "4:1@32", seed=0)
    with pytest.raises(TensorShapeError):
        select_columns(qt, torch.tensor([40]))
    with pytest.raises(TensorShapeError):
        select_group_rows(qt, 1, 1)
    with pytest.raises(TensorShapeError):
        balanced_group_ranges(qt, 3)  # 2 groups of 32 rows
