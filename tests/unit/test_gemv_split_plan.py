"""The TMA GEMV's per-run split plan (csrc/quant/exl2_gemv_splits.cuh through _Launch.gemv_splits): host code, so it
runs wherever the library loads. The balanced plan gives the run with the longest item more splits within the
launch's planned blocks; the proportional plan is the old per-run share of ksplit. Shapes are the 8B's at 4.0 bpw
on a 132-SM device (the H200)."""

from __future__ import annotations

import itertools

import pytest
import torch

from exl2_backend.ops import library

pytestmark = pytest.mark.skipif(not library.available(), reason="compiled library not loaded")

CPU = torch.device("cpu")
DOWN = (["8:0.05@32 4:0.95@128"], 14336, 4096)  # runs of 12 and 213 chunks
QKV = (["4:1@128"] * 3, 4096, 4096)
MIXED_QKV = (["4:0.1@128 3:0.9@128"] * 3, 4096, 1024)


def _launch(specs: list[str], k: int, n: int, sms: int = 132):
    from exl2_backend.ops import cuda_quant
    from tests.helpers.synth import random_qtensor

    launch = cuda_quant._Launch([cuda_quant.pack_qtensor(random_qtensor(f"p{i}", k, n, s, seed=i), CPU)
                                 for i, s in enumerate(specs)], CPU)
    launch.sms = sms
    return launch


def _splits(launch, m: int, mode: str, monkeypatch, waves: float = 1.0):
    from exl2_backend.ops import cuda_quant

    monkeypatch.setattr(cuda_quant, "GEMV_SPLITS", mode)
    monkeypatch.setattr(cuda_quant, "GEMV_WAVES", waves)
    return launch.gemv_splits(m)  # the plan cache is keyed by both settings


def _longest(launch, splits: list[list[int]]) -> int:
    """The longest item in chunk-bits (one column block's chunk of b bits is 2 KB x b)."""
    return max(-(-(end - start) // k) * bits
               for part, ks in zip(launch.parts, splits) for (bits, start, end, _), k in zip(part.runs, ks))


def test_down_gives_the_short_wide_run_a_second_split(monkeypatch):
    launch = _launch(*DOWN)
    assert _splits(launch, 1, "proportional", monkeypatch) == ([[1, 14]], 240)
    splits, blocks = _splits(launch, 1, "balanced", monkeypatch)
    assert (splits, blocks) == ([[2, 14]], 256)
    assert _longest(launch, splits) == 16 * 4  # 16 chunks of 4 bits, against 12 chunks of 8 bits before


@pytest.mark.parametrize("spec", [DOWN, QKV, MIXED_QKV])
@pytest.mark.parametrize("m", [1, 5, 32])
@pytest.mark.parametrize("waves", [1.0, 2.0])
def test_balanced_stays_in_budget_and_never_lengthens_the_launch(monkeypatch, spec, m, waves):
    launch = _launch(*spec)
    prop, prop_blocks = _splits(launch, m, "proportional", monkeypatch)
    bal, blocks = _splits(launch, m, "balanced", monkeypatch, waves)
    ks = launch.gemv_plan(m).ksplit
    assert blocks <= max(prop_blocks, int(132 * 2 * waves))
    assert _longest(launch, bal) <= _longest(launch, prop)
    for part, p, b in zip(launch.parts, prop, bal):
        assert all(x >= y for x, y in zip(b, p))  # only ever adds splits
        assert sum(b) <= ks + 6  # the workspace holds ksplit + _MAX_RUNS partials per column block
        assert all(k <= end - start for (_, start, end, _), k in zip(part.runs, b))
    ncol = [-(-part.N // 256) for part in launch.parts]
    assert blocks == sum(c * sum(b) for c, b in zip(ncol, bal))


def test_two_waves_split_the_mlp_gate_up(monkeypatch):
    launch = _launch(["4:0.1@32 3:0.9@32", "4:0.25@32 3:0.75@32"], 4096, 14336)
    one, blocks_one = _splits(launch, 1, "balanced", monkeypatch)
    assert (one, blocks_one) == ([[1, 1], [1, 1]], 224)  # 56 column blocks per part: no split fits 264 blocks
    two, blocks_two = _splits(launch, 1, "balanced", monkeypatch, waves=2.0)
    assert 224 < blocks_two <= 528 and _longest(launch, two) < _longest(launch, one)


def test_a_one_sm_plan_keeps_one_split(monkeypatch):
    launch = _launch(*QKV, sms=1)
    assert _splits(launch, 1, "balanced", monkeypatch) == ([[1], [1], [1]], 48)


@pytest.mark.parametrize("spec, sms, group_rows", [
    ((["8:0.15@128 6:0.85@128"], 4096, 8192), 4, [128]),  # head-like: one split per run, 54 chunks of 6 bits
    (DOWN, 132, [32]),  # groups of 32 rows in the 8-bit run: two group ends per chunk bound it
    ((["4:1@128", "4:1@32"], 4096, 14336), 132, [128, 32]),  # the most of any part (gate @128, up @32)
])
def test_staged_groups_are_bounded_by_the_smallest_group(monkeypatch, spec, sms, group_rows):
    launch = _launch(*spec, sms=sms)
    assert [part.group_rows for part in launch.parts] == group_rows
    splits, _ = _splits(launch, 1, "balanced", monkeypatch)
    maxnch = max(-(-(end - start) // k) for part, ks in zip(launch.parts, splits)
                 for (_, start, end, _), k in zip(part.runs, ks))
    want = max(min(2 * maxnch + 1, -(-maxnch * 64 // g) + 1) for g in group_rows)
    assert launch.gemv_staged_groups(1) == want
    if sms == 4:
        assert (maxnch, want) == (54, 28)  # 14 KB of staged scales per block instead of 56 KB


def _chunk_at(runs, target: int) -> int:
    """The first chunk whose cumulative chunk-bits reach `target` (exl2_quant.cuh chunk_at)."""
    acc = 0
    for bits, start, end, _ in runs:
        w = (end - start) * bits
        if target < acc + w:
            return start + -(-(target - acc) // bits)
        acc += w
    return runs[-1][2]


def _span_items(part, k: int) -> list[tuple[int, int]]:
    w = sum((end - start) * bits for bits, start, end, _ in part.runs)
    return [(_chunk_at(part.runs, w * s // k), _chunk_at(part.runs, w * (s + 1) // k)) for s in range(k)]


def _item_bits(part, c0: int, c1: int) -> int:
    return sum(max(0, min(c1, end) - max(c0, start)) * bits for bits, start, end, _ in part.runs)


def test_span_splits_cross_width_runs_with_equal_bytes(monkeypatch):
    launch = _launch(["4:0.1@32 3:0.9@32", "4:0.25@32 3:0.75@32"], 4096, 14336)
    splits, blocks = _splits(launch, 1, "span", monkeypatch)
    assert (splits, blocks) == ([[2, 0], [2, 0]], 224)  # ksplit 2 per column block, no split per run
    per_run, _ = _splits(launch, 1, "balanced", monkeypatch)
    for part in launch.parts:
        items = _span_items(part, 2)
        assert items[0][0] == 0 and items[-1][1] == part.C and all(a[1] == b[0] for a, b in itertools.pairwise(items))
        assert items[0][1] > part.runs[0][2]  # the first split covers the 4-bit run and part of the 3-bit run
        costs = [_item_bits(part, c0, c1) for c0, c1 in items]
        assert max(costs) - min(costs) <= 2 * 4  # equal bytes within a chunk or so
    longest_span = max(_item_bits(p, c0, c1) for p in launch.parts for c0, c1 in _span_items(p, 2))
    assert longest_span < 0.65 * _longest(launch, per_run)  # 106 against 174 chunk-bits (58 chunks of 3 bits)
    _splits(launch, 1, "span", monkeypatch)
    maxnch = max(c1 - c0 for p in launch.parts for c0, c1 in _span_items(p, 2))
    assert launch.gemv_staged_groups(1) == min(2 * maxnch + 1, maxnch * 64 // 32 + 1)


def test_span_splits_only_where_they_pay(monkeypatch):
    # down (8:0.05 4:0.95): span items would be ~59 chunk-bits against 64 per run: the per-run plan stays
    assert _splits(_launch(*DOWN), 1, "span", monkeypatch) == _splits(_launch(*DOWN), 1, "balanced", monkeypatch)
    # one run: nothing to span
    assert _splits(_launch(*QKV), 1, "span", monkeypatch) == _splits(_launch(*QKV), 1, "balanced", monkeypatch)
    # a head-like launch whose per-run plan needs several waves (64 items on 8 slots): one span item per column
    # block instead of one per column block and run
    head = _launch(["8:0.15@128 6:0.85@128"], 4096, 8192, sms=4)
    assert _splits(head, 1, "balanced", monkeypatch) == ([[1, 1]], 64)
    assert _splits(head, 1, "span", monkeypatch) == ([[1, 0]], 32)


def test_a_plan_follows_the_split_settings_it_was_made_under(monkeypatch):
    """The plan cache is keyed by every setting its descriptors depend on: a plan made under span splits is not
    reused once per-run splits are asked for (the chain and its tests need per-run splits), nor one made for
    another number of waves."""
    from exl2_backend.ops import cuda_quant
    from exl2_backend.ops.cuda_quant import F_SLOTS, F_SPAN

    launch = _launch(*DOWN)
    monkeypatch.setattr(cuda_quant, "GEMV_SPLITS", "span")
    assert launch.gemv_plan(1).blob[0, F_SPAN] == 1
    monkeypatch.setattr(cuda_quant, "GEMV_SPLITS", "balanced")
    one_wave = launch.gemv_plan(1).blob
    assert one_wave[0, F_SPAN] == 0
    monkeypatch.setattr(cuda_quant, "GEMV_WAVES", 2.0)
    assert launch.gemv_plan(1).blob[0, F_SLOTS] == 2 * one_wave[0, F_SLOTS]
