"""Greedy decode steps whose host I/O runs inside the captured graph (on by default, EXL2_BACKEND_GRAPH_IO=0 turns
it off; the decode lookahead's steps, runtime/lookahead.py).

A plain graph step is five stream operations: the staging upload, the lookahead's token copy, the graph (whose
first nodes unpack the staging rows), the greedy sampler and the readback. H200 call AL2 of 2026-12-04 (8B at 1k):
the engine's step took 38.6 us longer than its graph replay, 28 us of it idle gaps between those operations.
Here each bucket has two graphs, parity 0 and 1, and a step is one launch of one of them:

    decode_inputs(stage[p] -> static inputs; a token of -1 takes tokens[1 - p])   reads pinned host memory
    model.forward(static inputs) -> last-token logits
    greedy sampler -> tokens[p]                                                     writes pinned host memory

Launches alternate the parity, so a step reads the previous launch's tokens without a copy, and the host fills
one parity's staging rows while the other parity's graph may still be queued or running. Before it rewrites
stage[p] (and before tokens[p] is rewritten), the last launch of parity p must be complete: each launch records
an event, and the next launch of its parity waits for it (two launches later, normally long done).
"""

from __future__ import annotations

import logging

import torch

from exl2_backend.ops.reference_decode_io import STAGE_FIELDS
from exl2_backend.runtime.cuda_graphs import CudaGraphRunner, fill_stage_rows

log = logging.getLogger("exl2_backend")


class GreedyGraphs:
    """Per batch bucket of `runner`, the two parity graphs of a greedy decode step (capture_all at load, or on
    first use)."""

    def __init__(self, runner: CudaGraphRunner):
        from exl2_backend.ops import cuda_decode_io

        self.runner = runner
        self._io = cuda_decode_io
        n, w = runner.buckets[-1], runner.max_pages_per_seq
        self.stage = torch.zeros(2, n, STAGE_FIELDS + w, dtype=torch.int64).pin_memory()  # [parity, Bmax, 4 + W]
        self._stage_np = self.stage.numpy()
        self.tokens = torch.zeros(2, n, dtype=torch.int64).pin_memory()  # [parity, Bmax]: each graph's greedy tokens
        warm = torch.zeros(n, dtype=torch.int64).pin_memory()  # the sampler's eager warm-up writes here
        # device addresses of the pinned buffers, looked up now: never during a capture
        self._stage_m, self._tokens_m, self._warm_m = (cuda_decode_io.MappedHost(t) for t in (self.stage,
                                                                                              self.tokens, warm))
        self._graphs: dict[int, list[torch.cuda.CUDAGraph]] = {}
        self._done: list[torch.cuda.Event | None] = [None, None]  # the last launch of each parity
        self._parity = 0
        self.launches = 0
        self.last: torch.cuda.CUDAGraph | None = None  # the graph of the last launch (bench: repeats that step)
        self.failed: str | None = None  # why a capture failed (then no more are tried; in the engine's stats)

    def _capture(self, bucket: int) -> list[torch.cuda.CUDAGraph]:
        r, io = self.runner, self._io
        if bucket not in r._graphs:  # the plain graph's capture warms the forward's lazy allocations
            r._reset_static()
            r._capture(bucket)
        # the sampler's persistent buffers (row counters, zero temperatures) are made outside the capture
        io.greedy_tokens_to_host(r._outputs[bucket], self._warm_m.view(self._warm_m.tensor[:bucket]))
        graphs = []
        for p in (0, 1):
            stage = self._stage_m.view(self.stage[p, :bucket])
            prev = self._tokens_m.view(self.tokens[1 - p, :bucket])
            out = self._tokens_m.view(self.tokens[p, :bucket])
            r._reset_static()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=r._pool):
                io.decode_inputs(stage, prev, r._ids[:bucket], r._pos[:bucket], r._lens[:bucket], r._slots[:bucket],
                                 r._tables[:bucket])
                logits = r.model.forward(r._ids[:bucket], r._pos[:bucket], r.cache, r._meta(bucket), logits="last")
                io.greedy_tokens_to_host(logits, out)
            graphs.append(graph)
        log.info("exl2_backend: captured greedy decode graphs (host I/O inside) for batch bucket %d", bucket)
        self._graphs[bucket] = graphs
        return graphs

    def ready(self, bucket: int) -> bool:
        """Whether `bucket`'s graphs exist, capturing them now if not; False (logged, and for good) when the capture
        fails: the caller then runs plain graph steps."""
        if bucket in self._graphs:
            return True
        if self.failed is None:
            stream = torch.cuda.current_stream()
            try:
                self._capture(bucket)
                return True
            except Exception as exc:  # noqa: BLE001 - the plain graph steps are a correct fallback
                # torch.cuda.graph leaves its side stream current when the capture's end raises
                torch.cuda.set_stream(stream)
                self.failed = f"{type(exc).__name__}: {exc}"
                log.warning("exl2_backend: greedy graph capture failed (%s); plain graph steps", self.failed)
        return False

    def capture_all(self) -> None:
        """Every bucket's graphs now, as the plain runner's capture_all does at load: a capture during serving
        would stall the first step of each new batch size (two forwards captured, the device synchronized). Stops
        at the first failure (ready() logs it; plain graph steps run)."""
        for bucket in self.runner.buckets:
            if not self.ready(bucket):
                return

    def launch(self, tokens: list[int], starts: list[int], block_tables: list[list[int]]):
        """Queue one greedy decode step: per sequence its input token (or FROM_PREVIOUS: the previous launch's
        token of the same row, which needs the same sequences in the same order), position and pages.
        -> (pinned int64 [B] view of its tokens, event recorded after it); the view is valid until the next
        launch but one."""
        b = len(tokens)
        bucket = next(x for x in self.runner.buckets if x >= b)
        graphs = self._graphs.get(bucket) or self._capture(bucket)  # normally captured by ready()
        p = self._parity
        if self._done[p] is not None:
            self._done[p].synchronize()  # its graph has read stage[p], and tokens[p] was consumed before this call
        fill_stage_rows(self._stage_np[p], tokens, starts, block_tables, bucket, self.runner.page_size)
        graphs[p].replay()
        self.last = graphs[p]
        done = torch.cuda.Event()
        done.record()
        self._done[p] = done
        self._parity ^= 1
        self.launches += 1
        self.runner.replays += 1
        return self.tokens[p, :b], done
