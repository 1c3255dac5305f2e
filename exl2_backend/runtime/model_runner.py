"""Turns per-sequence step inputs into the model's tensors and runs one forward.

Every step (prefill chunk, decode, verify) is a batch of B sequences with the same number Tq of new
tokens. The runner builds the static-shaped inputs a CUDA-graph replay needs — token ids and positions
[B, Tq], block tables padded to a fixed width, context lengths [B], cache slots [B*Tq] — and calls the
model eagerly. A graph runner (decode buckets, decision 3) subclasses this and overrides `run` to copy
these tensors into captured buffers and replay.
"""

from __future__ import annotations

import torch

from exl2_backend.model import AttentionMetadata


class ModelRunner:
    """Eager runner (CPU, and CUDA until graphs are captured)."""

    def __init__(self, model, cache, max_pages_per_seq: int):
        self.model = model
        self.cache = cache
        self.page_size = cache.page_size
        self.max_pages_per_seq = max_pages_per_seq
        self.device = model.device

    def prepare(self, tokens: list[list[int]], starts: list[int], block_tables: list[list[int]],
                pad_pages: int | None = None):
        """-> (input_ids [B, Tq] int64, positions [B, Tq] int64, AttentionMetadata).

        tokens[b] are the new tokens of sequence b at positions starts[b]..starts[b]+Tq-1; block_tables[b]
        must already hold the pages for those positions. Tables are padded with page 0 (never read: the
        attention stops at context_lens) to `pad_pages` (default: the widest table in the batch)."""
        b = len(tokens)
        tq = len(tokens[0])
        if any(len(t) != tq for t in tokens):
            raise ValueError("all sequences of one forward need the same number of new tokens")
        width = pad_pages or max(len(t) for t in block_tables)
        table = torch.zeros(b, width, dtype=torch.int32)  # [B, max_pages]
        for i, pages in enumerate(block_tables):
            table[i, : len(pages)] = torch.tensor(pages, dtype=torch.int32)
        start = torch.tensor(starts, dtype=torch.int64)[:, None]  # [B, 1]
        positions = start + torch.arange(tq, dtype=torch.int64)[None, :]  # [B, Tq]
        s = self.page_size
        slots = table.long().gather(1, positions // s) * s + positions % s  # [B, Tq]
        meta = AttentionMetadata(
            block_tables=table.to(self.device),
            context_lens=(start[:, 0] + tq).to(torch.int32).to(self.device),  # [B]
            slots=slots.reshape(-1).to(self.device),  # [B*Tq]
        )
        input_ids = torch.tensor(tokens, dtype=torch.int64).to(self.device)
        return input_ids, positions.to(self.device), meta

    def run(self, tokens: list[list[int]], starts: list[int], block_tables: list[list[int]],
            logits: str = "last") -> torch.Tensor:
        """One forward; f32 logits [B, V] ("last") or [B, Tq, V] ("all")."""
        input_ids, positions, meta = self.prepare(tokens, starts, block_tables)
        return self.model.forward(input_ids, positions, self.cache, meta, logits=logits)
