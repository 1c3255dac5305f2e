"""The blocked prefill attention algorithm (ops/attention_prefill.py) on the CPU (its fp32 math kernel): the
chunk's causal self block, history key blocks with folded GQA heads and the log-sum-exp merge give the
reference's attention for every block size, history offset and head grouping."""

from __future__ import annotations

import pytest
import torch

from exl2_backend.errors import InvalidRequestError
from exl2_backend.ops import reference
from exl2_backend.ops.attention_prefill import prefill_attention


@pytest.mark.parametrize("hq,hkv", [(4, 2), (8, 1), (3, 3)])
@pytest.mark.parametrize("key_block", [1, 5, 16, 8192])
def test_blocks_match_reference(hq, hkv, key_block):
    g = torch.Generator().manual_seed(hq * 10 + key_block)
    pages, s, d, tq = 40, 16, 8, 17
    kc, vc = torch.randn(pages, s, hkv, d, generator=g), torch.randn(pages, s, hkv, d, generator=g)
    lens = torch.tensor([17, 40, 150], dtype=torch.int32)  # no history, one page + offset, several blocks
    tables = torch.stack([torch.randperm(pages, generator=g)[:12] for _ in range(3)]).int()
    q = torch.randn(3, tq, hq, d, generator=g)
    ref = reference.paged_attention(q, kc, vc, tables, lens, 0.3)
    out = prefill_attention(q, kc, vc, tables, lens, 0.3, key_block=key_block)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


def test_bad_inputs():
    kc = torch.zeros(4, 16, 1, 8)
    q = torch.zeros(1, 20, 1, 8)
    tables = torch.zeros(1, 4, dtype=torch.int32)
    with pytest.raises(InvalidRequestError, match="shorter than the chunk"):
        prefill_attention(q, kc, kc, tables, torch.tensor([10], dtype=torch.int32), 1.0)
    with pytest.raises(InvalidRequestError, match="key_block"):
        prefill_attention(q, kc, kc, tables, torch.tensor([20], dtype=torch.int32), 1.0, key_block=0)
