"""A fixed sequence of model steps on a fresh paged cache, for tests that compare two paths bit for bit."""

from __future__ import annotations

import torch


def prefill_then_decode(model) -> list[torch.Tensor]:
    """A 5-token prefill (logits of every position), one decode step of that sequence, then one decode step of three
    sequences sharing its pages (M = 3): the logits of each step, on a fresh 8-page cache of 16-token pages."""
    from exl2_backend.model.layers import AttentionMetadata

    dev = model.device
    cache = model.make_cache(num_pages=8, page_size=16)
    i32 = {"dtype": torch.int32, "device": dev}
    bt = torch.arange(8, **i32).view(1, 8)
    meta = AttentionMetadata(bt, torch.tensor([5], **i32), torch.arange(5, device=dev))
    ids = torch.tensor([[5, 17, 42, 99, 7]], device=dev)
    out = [model.forward(ids, torch.arange(5, device=dev).view(1, 5), cache, meta, logits="all")]
    meta1 = AttentionMetadata(bt, torch.tensor([6], **i32), torch.tensor([5], device=dev))
    out.append(model.forward(torch.tensor([[11]], device=dev), torch.full((1, 1), 5, device=dev), cache, meta1))
    bt3 = torch.arange(24, **i32).view(3, 8) % 8  # three sequences on the same pages
    meta3 = AttentionMetadata(bt3, torch.tensor([7, 7, 7], **i32), torch.tensor([6, 6, 6], device=dev))
    out.append(model.forward(torch.tensor([[3], [3], [3]], device=dev), torch.full((3, 1), 6, device=dev), cache,
                             meta3))
    return out
