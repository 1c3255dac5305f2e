"""The L2 lookahead's ranges (exl2_gemv_lookahead_ranges, host code of the compiled library; ops/cuda_lookahead.py):
which bytes of a GEMV the launch before it prefetches. Runs wherever the library loads (no GPU needed: the ranges
are host arithmetic over the packed tensors' addresses, here CPU ones).

What must hold: every range lies inside the tensor it names, starts and ends on 16 bytes (the bulk prefetch's
alignment); the target's constants come whole; each split of its one-row launch gets one range from the split's
first byte, shares proportional to the split's size, within the budget; a budget past the weights covers them all.
"""

from __future__ import annotations

import ctypes

import numpy as np
import pytest
import torch

from exl2_backend.errors import KernelUnavailableError
from exl2_backend.ops import library

pytestmark = pytest.mark.skipif(not library.available(), reason="compiled library not loaded")

CPU = torch.device("cpu")


def _launch(option: str, k: int, n: int, parts: int = 1, seed: int = 0):
    from exl2_backend.ops import cuda_quant
    from tests.helpers.synth import random_qtensor

    packed = [cuda_quant.pack_qtensor(random_qtensor(f"p{i}", k, n, option, seed=seed + i), CPU) for i in range(parts)]
    return cuda_quant._Launch(packed, CPU)


def _split_starts(launch) -> list[tuple[int, int, int]]:
    """(part, first byte, bytes) of every split of the one-row GEMV launch, by the kernel's rule (gv_work_at)."""
    pl = launch.gemv_plan(1)
    out = []
    for i, p in enumerate(launch.parts):
        w = sum((end - start) * bits for bits, start, end, _ in p.runs)
        for bits, start, end, word_base in p.runs:
            nr = end - start
            k = min(nr, max(1, pl.ksplit * nr * bits // w))
            row = p.Np * 8 * bits  # one chunk row (64 rows) of this run
            for s in range(k):
                c0, c1 = nr * s // k, nr * (s + 1) // k
                out.append((i, p.packed.data_ptr() + 4 * word_base + c0 * row, (c1 - c0) * row))
    return out


def _constants(launch) -> list[tuple[int, int]]:
    return [(t.data_ptr(), t.numel() * t.element_size()) for p in launch.parts for t in (p.info, p.xmap, p.scl16)]


@pytest.mark.parametrize("option,k,n,parts", [("4:1@128", 4096, 1024, 1), ("5:0.1@128 4:0.9@128", 4096, 2048, 1),
                                              ("8:0.05@32 4:0.95@128", 2048, 512, 2),
                                              ("6:0.3@32 3:0.4@64 2:0.3@128", 1056, 300, 3)])
@pytest.mark.parametrize("budget", [0, 1 << 16, 1 << 20])
def test_ranges_are_each_splits_first_bytes_within_the_budget(option, k, n, parts, budget):
    from exl2_backend.ops.cuda_lookahead import lookahead_ranges

    launch = _launch(option, k, n, parts)
    got = lookahead_ranges(launch, budget)  # int64 [n, 2]
    assert got.dtype == np.int64 and got.ndim == 2 and got.shape[1] == 2
    assert (got[:, 0] % 16 == 0).all() and (got[:, 1] % 16 == 0).all() and (got[:, 1] > 0).all()
    consts = _constants(launch)
    for (addr, size), (want_addr, want_size) in zip(got[: len(consts)], consts):
        assert addr == want_addr and want_size - 16 < size <= want_size  # whole, ends rounded down to 16
    splits = _split_starts(launch)
    weights = got[len(consts):]
    total = sum(b for _, _, b in splits)
    if budget == 0:
        assert len(weights) == 0
        return
    nonzero = [s for s in splits if min(s[2], budget * s[2] // total) >= 16]
    assert len(weights) == len(nonzero)
    for (addr, size), (_, start, nbytes) in zip(weights, nonzero):
        assert addr == start and size <= nbytes
        assert abs(size - min(nbytes, budget * nbytes / total)) <= 16  # its share, rounded down to 16
    assert min(budget, total) - 16 * len(splits) <= weights[:, 1].sum() <= min(budget, total)


def test_a_budget_past_the_weights_covers_them_all():
    from exl2_backend.ops.cuda_lookahead import lookahead_ranges

    launch = _launch("5:0.1@128 4:0.9@128", 4096, 1024, parts=2)
    got = lookahead_ranges(launch, 1 << 40)
    weights = got[len(_constants(launch)):]
    assert weights[:, 1].sum() == sum(p.packed.numel() * 4 for p in launch.parts)
    spans = sorted(map(tuple, weights))
    for (a, n), (b, _) in zip(spans, spans[1:]):  # the splits tile each part's words without overlap
        assert a + n <= b


def test_bad_arguments_are_typed_errors():
    from exl2_backend.ops.cuda_lookahead import lookahead_ranges
    from exl2_backend.ops.cuda_quant import _fn

    launch = _launch("4:1@128", 4096, 1024)
    with pytest.raises(KernelUnavailableError, match="budget"):
        lookahead_ranges(launch, -1)
    blob = launch.gemv_plan(1).blob
    out, count = np.zeros((2, 2), dtype=np.int64), ctypes.c_int(7)
    st = _fn("exl2_gemv_lookahead_ranges")(blob.ctypes.data, 1, 1 << 20, out.ctypes.data, 2, ctypes.addressof(count))
    with pytest.raises(KernelUnavailableError, match="more than 2 ranges"):
        library.check(st, "exl2_gemv_lookahead_ranges")
    bad = blob.copy()
    bad[0, 12] = 0  # F_N: a malformed descriptor
    st = _fn("exl2_gemv_lookahead_ranges")(bad.ctypes.data, 1, 1 << 20, out.ctypes.data, 2, ctypes.addressof(count))
    with pytest.raises(KernelUnavailableError, match="bad N"):
        library.check(st, "exl2_gemv_lookahead_ranges")


def test_a_linked_launch_carries_its_ranges_in_the_first_descriptor():
    from exl2_backend.ops import cuda_quant
    from exl2_backend.ops.cuda_lookahead import lookahead_ranges

    src, dst = _launch("4:1@128", 1024, 512, parts=3), _launch("4:1@128", 512, 1024, seed=5)
    ranges = lookahead_ranges(dst, 1 << 18)
    dev = torch.from_numpy(ranges)
    src.lookahead_fields = (dev.data_ptr(), len(ranges), int(ranges[:, 1].sum()))
    ws, counters = torch.zeros(1 << 20), torch.zeros(64, dtype=torch.int32)
    _, blob = src._bind(src.gemv_plan(1), 1, ws, counters, CPU)
    assert tuple(blob[0, cuda_quant.F_LOOKAHEAD:cuda_quant.F_LOOKAHEAD_BYTES + 1]) == src.lookahead_fields
    assert not blob[1:, cuda_quant.F_LOOKAHEAD:].any()
    assert cuda_quant._DESC_LEN == cuda_quant.F_LOOKAHEAD_BYTES + 1
