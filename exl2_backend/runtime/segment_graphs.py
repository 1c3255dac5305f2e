"""Decode CUDA graphs for a layer split (model/split.py): one graph per device segment and batch bucket.

A CUDA graph belongs to one device, so the decode step of a split model is captured segment by segment, each
on its own device's static buffers (token ids on the first; positions, block tables, context lengths and
cache slots on every device; the incoming [2, b, H] hidden state of each bucket on every device after the
first). A step uploads the inputs to every device, replays segment 0, copies its [2, b, H] output (MLP output
and residual stream, stacked inside the graph so the boundary costs one device-to-device copy) into segment
1's input buffer, replays segment 1, and so on; the last segment's graph yields the logits. Copies and replays are
stream-ordered on the devices' current streams (torch synchronises the two streams of a cross-device copy
with events), so the host never waits inside a step.

Like CudaGraphRunner: prefill chunks and multi-token steps run eagerly; padded rows of a bucket write no KV
(slot -1) and attend to one cached position of page 0; their logits are dropped.
"""

from __future__ import annotations

import logging

import torch

from exl2_backend.model import AttentionMetadata
from exl2_backend.ops.reference_decode_io import STAGE_FIELDS
from exl2_backend.runtime.cuda_graphs import DECODE_BUCKETS, fill_stage_rows
from exl2_backend.runtime.model_runner import ModelRunner

log = logging.getLogger("exl2_backend")


class _Statics:
    """The captured input buffers of one segment, on its device."""

    def __init__(self, device: torch.device, n: int, width: int, hidden: int, dtype: torch.dtype, first: bool):
        self.device = device
        self.ids = torch.zeros(n, 1, dtype=torch.int64, device=device) if first else None  # [Bmax, 1]
        # incoming (h, residual) per batch bucket, [2, b, H] each: contiguous, so the hand-over is one copy
        self.state: dict[int, torch.Tensor] = {}
        self.hidden, self.dtype, self.first = hidden, dtype, first
        self.pos = torch.zeros(n, 1, dtype=torch.int64, device=device)  # [Bmax, 1]
        self.tables = torch.zeros(n, width, dtype=torch.int32, device=device)  # [Bmax, max_pages]
        self.lens = torch.ones(n, dtype=torch.int32, device=device)  # [Bmax]
        self.slots = torch.full((n,), -1, dtype=torch.int64, device=device)  # [Bmax]
        self.stage_dev = torch.zeros(n, STAGE_FIELDS + width, dtype=torch.int64, device=device)
        self.uploaded = torch.cuda.Event()

    def meta(self, b: int) -> AttentionMetadata:
        return AttentionMetadata(block_tables=self.tables[:b], context_lens=self.lens[:b], slots=self.slots[:b])

    def state_in(self, b: int) -> torch.Tensor:
        if b not in self.state:
            self.state[b] = torch.zeros(2, b, self.hidden, dtype=self.dtype, device=self.device)
        return self.state[b]

    def reset(self) -> None:
        for t in (self.ids, self.pos, self.tables, *self.state.values()):
            if t is not None:
                t.zero_()
        self.lens.fill_(1)
        self.slots.fill_(-1)

    def scatter(self, stage: torch.Tensor, bucket: int) -> None:
        """Copy the pinned staging rows [ids | pos | lens | slots | tables] in and spread them (stream-ordered)."""
        dev = self.stage_dev[:bucket]
        dev.copy_(stage[:bucket], non_blocking=True)
        self.uploaded.record()
        if self.ids is not None:
            self.ids[:bucket, 0] = dev[:, 0]
        self.pos[:bucket, 0] = dev[:, 1]
        self.lens[:bucket] = dev[:, 2].to(torch.int32)
        self.slots[:bucket] = dev[:, 3]
        self.tables[:bucket] = dev[:, STAGE_FIELDS:].to(torch.int32)


class SegmentGraphRunner(ModelRunner):
    """ModelRunner for a SplitLlamaModel whose decode steps replay one graph per segment."""

    def __init__(self, model, cache, max_pages_per_seq: int, max_batch_size: int):
        super().__init__(model, cache, max_pages_per_seq)
        self.buckets = [b for b in DECODE_BUCKETS if b < max_batch_size] + [max_batch_size]
        n, w = self.buckets[-1], max_pages_per_seq
        hidden = model.config.hidden_size
        self.statics = [_Statics(seg.device, n, w, hidden, model.dtype, first=(s == 0))
                        for s, seg in enumerate(model.segments)]
        self._stage = torch.zeros(n, STAGE_FIELDS + w, dtype=torch.int64).pin_memory()  # one staging row per sequence
        self._segment_graphs: dict[int, list[torch.cuda.CUDAGraph]] = {}
        self._outputs: dict[int, list[torch.Tensor]] = {}
        self._pools: dict[torch.device, object] = {}
        self.replays = 0

    # --- capture ---------------------------------------------------------------------------------------------

    def _segment_step(self, s: int, b: int) -> torch.Tensor:
        """Segment s of a decode step on the static buffers: [2, b, H] state, or [b, V] logits after the last."""
        st = self.statics[s]
        inp = st.ids[:b] if s == 0 else tuple(st.state_in(b))  # (h, residual) [b, H] each
        with torch.inference_mode():
            out = self.model.run_segment(s, inp, st.pos[:b], self.cache.segments[s], st.meta(b), b, 1, "last")
            if s < len(self.statics) - 1:
                out = torch.stack(out)  # [2, b, H]: one copy across the boundary
        return out

    def _capture(self, b: int) -> None:
        graphs, outs = [], []
        for s, st in enumerate(self.statics):
            dev = st.device
            with torch.cuda.device(dev):
                stream = torch.cuda.Stream(dev)
                stream.wait_stream(torch.cuda.current_stream(dev))
                with torch.cuda.stream(stream):  # warm-up outside capture: lazy allocations, kernel selection
                    for _ in range(2):
                        self._segment_step(s, b)
                torch.cuda.current_stream(dev).wait_stream(stream)
                if dev not in self._pools:
                    self._pools[dev] = torch.cuda.graph_pool_handle()
                graph = torch.cuda.CUDAGraph()
                # an explicit capture stream on this device: torch's default one lives on the device that was
                # current when the first graph of the process was captured
                with torch.cuda.graph(graph, pool=self._pools[dev], stream=stream):
                    out = self._segment_step(s, b)
            graphs.append(graph)
            outs.append(out)
        self._segment_graphs[b], self._outputs[b] = graphs, outs
        log.info("exl2_backend: captured %d segment decode graphs for batch bucket %d", len(graphs), b)

    def capture_all(self) -> None:
        """Capture every bucket now (largest first, so smaller graphs reuse the pools' memory)."""
        for b in reversed(self.buckets):
            if b not in self._segment_graphs:
                self._reset_static()
                self._capture(b)

    def _reset_static(self) -> None:
        for st in self.statics:
            st.reset()

    # --- steps -----------------------------------------------------------------------------------------------

    def _upload(self, tokens, starts, block_tables, bucket: int) -> None:
        st = self._stage
        for x in self.statics:  # the pinned rows are rewritten only after every device has copied them
            x.uploaded.synchronize()
        fill_stage_rows(st.numpy(), [t[0] for t in tokens], starts, block_tables, bucket, self.page_size)
        for x in self.statics:
            with torch.cuda.device(x.device):
                x.scatter(st, bucket)

    def run(self, tokens, starts, block_tables, logits: str = "last") -> torch.Tensor:
        b = len(tokens)
        if logits != "last" or len(tokens[0]) != 1 or b > self.buckets[-1]:
            return super().run(tokens, starts, block_tables, logits)
        bucket = next(x for x in self.buckets if x >= b)
        if bucket not in self._segment_graphs:
            self._reset_static()
            self._capture(bucket)
        self._upload(tokens, starts, block_tables, bucket)
        graphs, outs = self._segment_graphs[bucket], self._outputs[bucket]
        for s, graph in enumerate(graphs):
            with torch.cuda.device(self.statics[s].device):
                graph.replay()
            if s + 1 < len(graphs):
                self.statics[s + 1].state_in(bucket).copy_(outs[s], non_blocking=True)
        self.replays += 1
        return outs[-1][:b]
