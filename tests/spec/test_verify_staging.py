"""The verify graphs' staging rows (spec/verify_graphs.stage_rows) carry the same token ids, positions, cache
slots, context lengths and block tables as the eager runner's `prepare` (CPU: checked before any GPU run)."""

from __future__ import annotations

import torch

from exl2_backend.runtime.model_runner import ModelRunner
from exl2_backend.spec.verify_graphs import stage_rows


class _Model:
    device = torch.device("cpu")


class _Cache:
    page_size = 16


def test_stage_rows_match_eager_inputs():
    g = torch.Generator().manual_seed(0)
    runner = ModelRunner(_Model(), _Cache(), max_pages_per_seq=8)
    width, bucket, tq = 8, 4, 5
    tables = [[7, 3, 9], [1, 2], [4, 5, 6, 0, 8]]  # 3 sequences in a bucket of 4: one padded row
    starts = [30, 11, 60]  # windows crossing page boundaries
    tokens = torch.randint(0, 500, (3, tq), generator=g).tolist()
    st = torch.full((bucket + 2, 3 * tq + 1 + width), 99, dtype=torch.int64)
    stage_rows(st, tokens, starts, tables, bucket, tq, page_size=16)
    ids, pos, meta = runner.prepare(tokens, starts, tables, pad_pages=width)
    b = len(tokens)
    assert torch.equal(st[:b, :tq], ids)
    assert torch.equal(st[:b, tq : 2 * tq], pos)
    assert torch.equal(st[:b, 2 * tq : 3 * tq].reshape(-1), meta.slots)
    assert torch.equal(st[:b, 3 * tq], meta.context_lens.long())
    assert torch.equal(st[:b, 3 * tq + 1 :], meta.block_tables.long())
    pad = st[b:bucket]  # padded row: no KV write, context Tq over page 0
    assert (pad[:, 2 * tq : 3 * tq] == -1).all() and (pad[:, 3 * tq] == tq).all() and (pad[:, 3 * tq + 1 :] == 0).all()
    assert (st[bucket:] == 99).all()  # rows past the bucket untouched
