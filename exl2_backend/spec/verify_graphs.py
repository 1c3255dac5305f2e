"""Verify steps as captured CUDA graphs: a (k+1)-token forward per sequence, all logits.

A verify step reads the weights once, like a decode step, so on the GPU it should cost about as much; run
eagerly it would pay hundreds of kernel launches from Python instead. `VerifyGraphRunner` wraps the engine's
`CudaGraphRunner`: forwards with logits="all" and 2 <= Tq <= max_tq new tokens per sequence replay a graph
captured (lazily) per (batch bucket, Tq) on static buffers; everything else goes to the wrapped runner.
Padded rows write no KV (slots -1) and attend to Tq positions of page 0; their logits are dropped.
"""

from __future__ import annotations

import logging

import torch

from exl2_backend.model import AttentionMetadata

log = logging.getLogger("exl2_backend")


def stage_rows(st: torch.Tensor, tokens, starts, block_tables, bucket: int, tq: int, page_size: int) -> None:
    """Fill staging rows st [>= bucket, 3*Tq + 1 + width] int64 for a verify step: per sequence
    [ids (Tq) | positions (Tq) | cache slots (Tq) | context length | block table (width)]; rows past the batch
    are padding (no KV write, context Tq, page 0)."""
    st[:bucket].zero_()
    st[:bucket, tq : 2 * tq] = torch.arange(tq)
    st[:bucket, 2 * tq : 3 * tq] = -1
    st[:bucket, 3 * tq] = tq
    for i, (t, p, pages) in enumerate(zip(tokens, starts, block_tables)):
        pos = torch.arange(p, p + tq)  # [Tq]
        table = torch.as_tensor(pages, dtype=torch.int64)
        st[i, :tq] = torch.as_tensor(t, dtype=torch.int64)
        st[i, tq : 2 * tq] = pos
        st[i, 2 * tq : 3 * tq] = table[pos // page_size] * page_size + pos % page_size
        st[i, 3 * tq] = p + tq
        st[i, 3 * tq + 1 : 3 * tq + 1 + len(pages)] = table


class _Buffers:
    """Static inputs of the graphs with Tq new tokens per sequence."""

    def __init__(self, n: int, tq: int, width: int, device):
        self.ids = torch.zeros(n, tq, dtype=torch.int64, device=device)  # [Bmax, Tq]
        self.pos = torch.zeros(n, tq, dtype=torch.int64, device=device)  # [Bmax, Tq]
        self.slots = torch.full((n * tq,), -1, dtype=torch.int64, device=device)  # [Bmax*Tq]
        self.lens = torch.full((n,), tq, dtype=torch.int32, device=device)  # [Bmax]
        self.tables = torch.zeros(n, width, dtype=torch.int32, device=device)  # [Bmax, max_pages]
        # Pinned staging row per sequence: [ids (Tq) | pos (Tq) | slots (Tq) | len | table (width)] as int64.
        self.stage = torch.zeros(n, 3 * tq + 1 + width, dtype=torch.int64).pin_memory()
        self.stage_dev = torch.zeros(n, 3 * tq + 1 + width, dtype=torch.int64, device=device)
        self.uploaded = torch.cuda.Event()

    def reset(self, tq: int) -> None:
        self.ids.zero_()
        self.pos.zero_()
        self.slots.fill_(-1)
        self.lens.fill_(tq)
        self.tables.zero_()

    def meta(self, b: int, tq: int) -> AttentionMetadata:
        return AttentionMetadata(block_tables=self.tables[:b], context_lens=self.lens[:b], slots=self.slots[: b * tq])


class VerifyGraphRunner:
    """The engine's runner, with multi-token all-logits steps replayed from graphs (see module doc)."""

    def __init__(self, inner, max_tq: int):
        self.inner = inner
        self.max_tq = max_tq
        self._bufs: dict[int, _Buffers] = {}
        self._verify_graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self._verify_outputs: dict[tuple[int, int], torch.Tensor] = {}
        self._pool = None
        self._failed = False
        self.verify_replays = 0

    def __getattr__(self, name):  # everything else (page_size, buckets, decode graphs, ...) is the inner runner's
        return getattr(self.inner, name)

    def _buffers(self, tq: int) -> _Buffers:
        if tq not in self._bufs:
            self._bufs[tq] = _Buffers(self.inner.buckets[-1], tq, self.inner.max_pages_per_seq, self.inner.device)
        return self._bufs[tq]

    def _capture(self, b: int, tq: int) -> None:
        model, cache, dev = self.inner.model, self.inner.cache, self.inner.device
        buf = self._buffers(tq)
        buf.reset(tq)
        stream = torch.cuda.Stream(dev)
        stream.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(stream):  # warm-up outside capture: lazy allocations, kernel selection
            for _ in range(2):
                model.forward(buf.ids[:b], buf.pos[:b], cache, buf.meta(b, tq), logits="all")
        torch.cuda.current_stream(dev).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        with torch.cuda.graph(graph, pool=self._pool):
            out = model.forward(buf.ids[:b], buf.pos[:b], cache, buf.meta(b, tq), logits="all")
        self._verify_graphs[(b, tq)], self._verify_outputs[(b, tq)] = graph, out
        log.info("exl2_backend: captured verify graph for batch bucket %d, %d tokens", b, tq)

    def capture(self, batch_sizes, tqs) -> None:
        """Capture the graphs of these batch sizes (rounded up to buckets) and token counts now (warm-up)."""
        for b in batch_sizes:
            bucket = next((x for x in self.inner.buckets if x >= b), None)
            for tq in tqs:
                if bucket is None or not 2 <= tq <= self.max_tq or (bucket, tq) in self._verify_graphs:
                    continue
                try:
                    self._capture(bucket, tq)
                except Exception as exc:  # noqa: BLE001 - eager verify is a correct fallback
                    log.warning("exl2_backend: verify graph capture failed (%s); verifying eagerly", exc)
                    self._failed = True
                    return

    def _upload(self, buf: _Buffers, tokens, starts, block_tables, bucket: int, tq: int) -> None:
        buf.uploaded.synchronize()  # the staging rows are reused only after their last copy finished
        stage_rows(buf.stage, tokens, starts, block_tables, bucket, tq, self.inner.page_size)
        dev = buf.stage_dev[:bucket]
        dev.copy_(buf.stage[:bucket], non_blocking=True)
        buf.uploaded.record()
        buf.ids[:bucket] = dev[:, :tq]
        buf.pos[:bucket] = dev[:, tq : 2 * tq]
        buf.slots[: bucket * tq] = dev[:, 2 * tq : 3 * tq].reshape(-1)
        buf.lens[:bucket] = dev[:, 3 * tq].to(torch.int32)
        buf.tables[:bucket] = dev[:, 3 * tq + 1 :].to(torch.int32)

    def run(self, tokens, starts, block_tables, logits: str = "last") -> torch.Tensor:
        b, tq = len(tokens), len(tokens[0])
        if self._failed or logits != "all" or not 2 <= tq <= self.max_tq or b > self.inner.buckets[-1]:
            return self.inner.run(tokens, starts, block_tables, logits)
        bucket = next(x for x in self.inner.buckets if x >= b)
        key = (bucket, tq)
        if key not in self._verify_graphs:
            try:
                self._capture(bucket, tq)
            except Exception as exc:  # noqa: BLE001 - eager verify is a correct fallback
                log.warning("exl2_backend: verify graph capture failed (%s); verifying eagerly", exc)
                self._failed = True
                return self.inner.run(tokens, starts, block_tables, logits)
        buf = self._buffers(tq)
        self._upload(buf, tokens, starts, block_tables, bucket, tq)
        self._verify_graphs[key].replay()
        self.verify_replays += 1
        return self._verify_outputs[key][:b]
