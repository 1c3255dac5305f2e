"""Layer split over several devices (architecture decision 9): each device segment holds a contiguous run of
decoder layers and their KV pages; the embedding lives on the first segment, the final norm and head on the
last. Hidden states (the MLP output and the residual stream, [T, H] each) move to the next device at each
segment boundary: one transfer per boundary per step.

Every segment's cache is an ordinary `PagedKVCache` of its own layers on its own device; all segments share
the page ids and block tables the engine hands out (`SegmentedKVCache`), so the engine's page accounting is
the same as on one device. Layers keep their index *within* their segment (it indexes that segment's cache).

The same code runs with every segment on one device ("cpu", or one GPU): tests check that this gives the
unsplit model's output bit for bit. Decode graphs are captured per segment by runtime/segment_graphs.py.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from exl2_backend import ops
from exl2_backend.errors import ConfigError
from exl2_backend.model.layers import AttentionMetadata, DecoderLayer
from exl2_backend.model.llama import LlamaModel


@dataclass(frozen=True)
class Segment:
    """Decoder layers [first, end) on `device`."""

    device: torch.device
    first: int
    end: int

    @property
    def num_layers(self) -> int:
        return self.end - self.first


def segments_from_plan(plan) -> list[Segment]:
    """The plan's (device, first, end) list (VramPlan.segments) as Segments."""
    return [Segment(torch.device(d), a, b) for d, a, b in plan.segments()]


def check_segments(segments: list[Segment], num_layers: int) -> None:
    if not segments:
        raise ConfigError("a layer split needs at least one segment", field="gpu_split")
    pos = 0
    for s in segments:
        if s.first != pos or s.end < s.first:
            raise ConfigError(f"segments must cover layers 0..{num_layers} in order without gaps; got "
                              f"{[(str(x.device), x.first, x.end) for x in segments]}", field="gpu_split")
        pos = s.end
    if pos != num_layers:
        raise ConfigError(f"segments cover {pos} of the model's {num_layers} layers", field="gpu_split")
    if len({s.device.type for s in segments}) != 1:
        raise ConfigError("all segments of a layer split must be on one device type (all cuda or all cpu)",
                          field="gpu_split")


def meta_to(meta: AttentionMetadata, device: torch.device) -> AttentionMetadata:
    if meta.slots.device == device:
        return meta
    return AttentionMetadata(block_tables=meta.block_tables.to(device), context_lens=meta.context_lens.to(device),
                             slots=meta.slots.to(device))


class SegmentedKVCache:
    """One cache per segment (its layers, its device), addressed with the same page ids."""

    def __init__(self, caches: list):
        self.segments = caches
        first = caches[0]
        self.num_pages = first.num_pages
        self.page_size = first.page_size
        self.num_kv_heads = first.num_kv_heads
        self.head_dim = first.head_dim
        self.dtype = first.dtype
        self.device = first.device
        self.quantized = getattr(first, "quantized", False)
        self.num_layers = sum(c.num_layers for c in caches)

    @property
    def num_tokens(self) -> int:
        return self.num_pages * self.page_size

    def bytes_per_token(self) -> int:
        return sum(c.bytes_per_token() for c in self.segments)

    def total_bytes(self) -> int:
        return sum(c.total_bytes() for c in self.segments)

    def tensors(self) -> list[torch.Tensor]:
        return [t for c in self.segments for t in c.tensors()]

    def copy_pages(self, src: list[int], dst: list[int]) -> None:
        """Copy pages in every segment (prefix caching's copy-on-write)."""
        for c in self.segments:
            c.copy_pages(src, dst)


class _SegmentView:
    """A LlamaModel seen as one segment (its layer count and device) for LlamaModel.make_cache."""

    def __init__(self, model: LlamaModel, seg: Segment):
        self._model, self.num_layers, self.device = model, seg.num_layers, seg.device

    def __getattr__(self, name):
        return getattr(self._model, name)


class SplitLlamaModel(LlamaModel):
    """LlamaModel whose layers are spread over `segments`. `device` is the first segment's (inputs go there);
    forward returns logits on the last segment's device."""

    def __init__(self, config, weights, segments: list[Segment], dtype: torch.dtype = torch.float16):
        check_segments(segments, config.num_hidden_layers)
        self.segments = segments
        first, last = segments[0].device, segments[-1].device
        # The base class sets every common attribute and the embedding on the first device; layers and the
        # head are placed here instead.
        super().__init__(config, replace(weights, layers=[], lm_head=None), first, dtype)
        layers = iter(weights.layers)  # may be a generator: layers are built (and freed) one at a time
        self.segment_layers: list[list[DecoderLayer]] = []
        for seg in segments:
            self.segment_layers.append([DecoderLayer(i - seg.first, config, next(layers), seg.device, self.dtype)
                                        for i in range(seg.first, seg.end)])
        self.layers = [layer for seg in self.segment_layers for layer in seg]
        self.norm = self.norm.to(last)
        self.lm_head = None if weights.lm_head is None else ops.prepare_linear([weights.lm_head], last, self.dtype)
        # a tied head multiplies by the embedding table: the last device needs its own copy
        self.head_table = self.embed if (weights.lm_head is not None or last == first) else self.embed.to(last)
        self.inv_freqs = [self.inv_freq.to(seg.device) for seg in segments]
        # segments after only empty ones start the residual stream themselves (see run_segment)
        self.fresh_stream = [all(s.num_layers == 0 for s in segments[:i]) for i in range(len(segments))]

    @classmethod
    def from_dir(cls, model_dir: str | Path, segments: list[Segment],  # type: ignore[override]
                 dtype: torch.dtype = torch.float16) -> SplitLlamaModel:
        from exl2_backend.format.config import ModelConfig
        from exl2_backend.format.reader import load_weights

        config = ModelConfig.from_dir(model_dir)
        return cls(config, load_weights(model_dir, config), segments, dtype)

    @property
    def devices(self) -> list[torch.device]:
        return [s.device for s in self.segments]

    def make_cache(self, num_pages: int, page_size: int, *args, **kwargs) -> SegmentedKVCache:
        """One cache per segment, with the arguments LlamaModel.make_cache takes."""
        caches = [LlamaModel.make_cache(_SegmentView(self, seg), num_pages, page_size, *args, **kwargs)
                  for seg in self.segments]
        return SegmentedKVCache(caches)

    def head(self, x: torch.Tensor) -> torch.Tensor:
        if self.lm_head is None:
            logits = ops.dense_linear(x, self.head_table, None)
        else:
            logits = self.lm_head(x)
        return logits[:, : self.vocab_size].float()

    def run_segment(self, s: int, state, positions: torch.Tensor, cache, meta: AttentionMetadata, batch: int,
                    tq: int, logits: str = "last"):
        """Segment s of one step, everything on its device. state: input_ids [B, Tq] for s == 0, else the
        (h, residual) [T, H] pair of the previous segment. Returns that pair, or f32 logits after the last."""
        if s == 0:
            h, residual = ops.embedding(state.reshape(-1), self.embed), None  # [T, H]
        else:
            h, residual = state
            if self.fresh_stream[s]:
                residual = None
        h, residual = self.run_layers(self.segment_layers[s], h, residual, positions.reshape(-1), self.inv_freqs[s],
                                      cache, meta, batch)
        if s == len(self.segments) - 1:
            return self.run_head(h, residual, batch, tq, logits)
        return h, (h if residual is None else residual)

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, cache: SegmentedKVCache,
                meta: AttentionMetadata, logits: str = "last") -> torch.Tensor:
        """As LlamaModel.forward; inputs on the first device, logits on the last."""
        if logits not in ("last", "all"):
            raise ValueError(f"logits must be 'last' or 'all', got {logits!r}")
        b, tq = input_ids.shape
        state = input_ids
        for s, seg in enumerate(self.segments):
            dev = seg.device
            if s > 0:
                state = (state[0].to(dev), state[1].to(dev))
            # the kernel library launches on the current device: make it the segment's
            with torch.cuda.device(dev) if dev.type == "cuda" else contextlib.nullcontext():
                state = self.run_segment(s, state, positions.to(dev), cache.segments[s], meta_to(meta, dev), b, tq,
                                         logits)
        return state

    __call__ = forward

    def make_runner(self, cache: SegmentedKVCache, max_pages: int, settings):
        """The engine's runner for this model: decode graphs per segment on CUDA (runtime/segment_graphs.py),
        eager otherwise and when capture fails (logged; slower, same results)."""
        import logging

        from exl2_backend.runtime.model_runner import ModelRunner

        if self.device.type == "cuda" and settings.use_cuda_graphs and ops.cuda_enabled():
            from exl2_backend.runtime.segment_graphs import SegmentGraphRunner

            try:
                runner = SegmentGraphRunner(self, cache, max_pages, settings.max_batch_size)
                runner.capture_all()
                return runner
            except Exception as exc:  # noqa: BLE001 - eager decode is a correct fallback
                logging.getLogger("exl2_backend").warning(
                    "exl2_backend: segment graph capture failed (%s); decoding eagerly", exc)
        return ModelRunner(self, cache, max_pages)
