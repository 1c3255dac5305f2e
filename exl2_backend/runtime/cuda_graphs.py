"""Decode steps as captured CUDA graphs (architecture decision 3).

At batch 1 an 8B model needs ~1 ms of HBM traffic per token while a decode step launches hundreds of
kernels; from Python each launch costs several µs. So the decode forward (Tq = 1, last-token logits) is
captured once per batch-size bucket on static buffers — token ids, positions, block tables padded to the
full per-sequence width, context lengths, cache slots — and a step is one buffer upload plus one replay.
Prefill chunks and multi-token verify steps run eagerly. Padded rows of a bucket write no KV (slot -1) and
attend to one cached position of page 0; their logits are dropped.
"""

from __future__ import annotations

import logging

import torch

from exl2_backend.model import AttentionMetadata
from exl2_backend.ops.reference_decode_io import STAGE_FIELDS
from exl2_backend.runtime.model_runner import ModelRunner

log = logging.getLogger("exl2_backend")

DECODE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)


def fill_stage_rows(st, tokens, starts, block_tables, bucket: int, page_size: int) -> None:
    """Staging rows [bucket, 4 + max_pages] (numpy int64) of one decode step: per sequence [token | position |
    context length | cache slot | page ids]; padded rows attend to one position of page 0 and write no KV."""
    s = page_size
    st[:bucket] = 0
    st[:bucket, 2] = 1  # padded rows: context length 1
    st[:bucket, 3] = -1  # padded rows: no KV write
    for i, (t, p, pages) in enumerate(zip(tokens, starts, block_tables)):
        st[i, 0] = t
        st[i, 1] = p
        st[i, 2] = p + 1
        st[i, 3] = pages[p // s] * s + p % s
        st[i, STAGE_FIELDS : STAGE_FIELDS + len(pages)] = pages


class CudaGraphRunner(ModelRunner):
    """ModelRunner whose decode steps replay a CUDA graph of the smallest bucket that fits the batch."""

    def __init__(self, model, cache, max_pages_per_seq: int, max_batch_size: int):
        super().__init__(model, cache, max_pages_per_seq)
        self.buckets = [b for b in DECODE_BUCKETS if b < max_batch_size] + [max_batch_size]
        n, w, dev = self.buckets[-1], max_pages_per_seq, self.device
        self._ids = torch.zeros(n, 1, dtype=torch.int64, device=dev)  # [Bmax, 1]
        self._pos = torch.zeros(n, 1, dtype=torch.int64, device=dev)  # [Bmax, 1]
        self._tables = torch.zeros(n, w, dtype=torch.int32, device=dev)  # [Bmax, max_pages]
        self._lens = torch.ones(n, dtype=torch.int32, device=dev)  # [Bmax]
        self._slots = torch.full((n,), -1, dtype=torch.int64, device=dev)  # [Bmax]
        # One pinned staging row per step: [ids | pos | lens | slots | tables] as int64, uploaded in one copy.
        self._stage = torch.zeros(n, STAGE_FIELDS + w, dtype=torch.int64).pin_memory()
        self._stage_np = self._stage.numpy()  # filled from Python through numpy: ~100x cheaper than tensor indexing
        self._stage_dev = torch.zeros(n, STAGE_FIELDS + w, dtype=torch.int64, device=dev)
        self._uploaded = torch.cuda.Event()  # the staging buffer is reused only after its last copy finished
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._outputs: dict[int, torch.Tensor] = {}
        self._pool = None
        self.replays = 0

    def _meta(self, b: int) -> AttentionMetadata:
        return AttentionMetadata(block_tables=self._tables[:b], context_lens=self._lens[:b], slots=self._slots[:b])

    def _capture(self, b: int) -> None:
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):  # warm-up: lazy allocations and kernel selection happen outside capture
            for _ in range(2):
                self.model.forward(self._ids[:b], self._pos[:b], self.cache, self._meta(b), logits="last")
        torch.cuda.current_stream(self.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        with torch.cuda.graph(graph, pool=self._pool):
            self._scatter_stage(b)  # the graph itself unpacks the uploaded staging rows: one copy per step from Python
            out = self.model.forward(self._ids[:b], self._pos[:b], self.cache, self._meta(b), logits="last")
        self._graphs[b], self._outputs[b] = graph, out
        log.info("exl2_backend: captured decode graph for batch bucket %d", b)

    def capture_all(self) -> None:
        """Capture every bucket now (largest first, so smaller graphs reuse its memory pool)."""
        for b in reversed(self.buckets):
            if b not in self._graphs:
                self._reset_static()
                self._capture(b)

    def _reset_static(self) -> None:
        self._ids.zero_()
        self._pos.zero_()
        self._tables.zero_()
        self._lens.fill_(1)
        self._slots.fill_(-1)

    def _scatter_stage(self, b: int) -> None:
        """staging rows [b, 4 + max_pages] on the device -> the static inputs (captured into each graph)."""
        dev = self._stage_dev[:b]
        self._ids[:b, 0] = dev[:, 0]
        self._pos[:b, 0] = dev[:, 1]
        self._lens[:b] = dev[:, 2].to(torch.int32)
        self._slots[:b] = dev[:, 3]
        self._tables[:b] = dev[:, STAGE_FIELDS:].to(torch.int32)

    def _upload(self, tokens, starts, block_tables, bucket: int) -> None:
        """Fill the pinned staging rows for this step and copy them to the device (the graph unpacks them)."""
        self._uploaded.synchronize()
        fill_stage_rows(self._stage_np, [t[0] for t in tokens], starts, block_tables, bucket, self.page_size)
        self._stage_dev[:bucket].copy_(self._stage[:bucket], non_blocking=True)
        self._uploaded.record()

    def run(self, tokens, starts, block_tables, logits: str = "last") -> torch.Tensor:
        b = len(tokens)
        if logits != "last" or len(tokens[0]) != 1 or b > self.buckets[-1]:
            return super().run(tokens, starts, block_tables, logits)
        bucket = next(x for x in self.buckets if x >= b)
        if bucket not in self._graphs:
            self._reset_static()
            self._capture(bucket)
        self._upload(tokens, starts, block_tables, bucket)
        self._graphs[bucket].replay()
        self.replays += 1
        return self._outputs[bucket][:b]
