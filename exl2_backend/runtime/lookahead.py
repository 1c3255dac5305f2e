"""Decode lookahead: keep the next decode step on the GPU while Python handles this one.

At batch 1 a decode step is ~2.3 ms of GPU work (8B shape) and ~0.5 ms of Python (upload, sampling readback,
detokenization, stop strings, events). Run one after the other, the GPU idles for the Python part. Here a
`decode` call enqueues the step *after* the one it returns before reading that one's tokens back: the next
step's input token is the sampled token still on the device, copied into the graph's staging row on the stream.
The next call finds that step already running and only enqueues the one after it.

Exactness: the lookahead step is the step plain decoding would run next, on the same graph and inputs, and it
samples through the very function eager decoding samples with (sampler.sample_on_device, which never waits for
the device), so tokens are identical. It samples when queued if nothing its sampling reads changes with the token
still in flight in a way the device cannot follow (penalty counts add it on the device, min_tokens' ban counts it,
logprobs are computed there). A grammar's mask needs its matcher to have consumed that token on the host: a batch
holding a constrained sequence queues only the forward (its logits copied aside) and samples when the step is
consumed, which still overlaps the forward with the host's work on the token before. Sampled rows of a step sampled
when queued draw their uniforms one step early; a dropped step restores their generators' states, so the next
draw is the one plain decoding makes. A queued step is used only if the next call names the very same Sequence
objects in the same order, each exactly one token further, with at least two tokens left; otherwise it is dropped.
Dropping is safe: its side effects are the K/V of position p+1 of its sequences, in pages they own (grown within
their admission reservation) and rewritten with the same values by the step that plain decoding runs (pages freed
meanwhile are reused only by work queued later on the same stream), and the generator draws it undoes.

By default (EXL2_BACKEND_GRAPH_IO=0 turns it off) a plain greedy step is one launch of a greedy graph whose host
I/O runs inside it (runtime/greedy_graphs.py): the lookahead step's input token is read from the previous launch's
output by the graph itself. H200 call AN1 (2026-12-05, 8B at 1k): the engine step 2,249.7 us against 2,269.5
without it, the idle time per step 1.9 us against 37.2. Every other batch takes the plain graph steps with the
sampler after the replay.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import torch

from exl2_backend.ops.host_copy import to_device
from exl2_backend.ops.reference_decode_io import FROM_PREVIOUS
from exl2_backend.runtime.cuda_graphs import CudaGraphRunner
from exl2_backend.runtime.logprobs import entries_from, logprob_tensors
from exl2_backend.runtime.sampler import NAN_LOGITS, sample_on_device

log = logging.getLogger("exl2_backend")


@dataclass
class _Flight:
    """One enqueued decode step: its sequences, the sampled tokens on the device and their host copy."""

    seqs: tuple  # the Sequence objects, in batch order
    expect: tuple[int, ...]  # each sequence's num_tokens when the step's result is consumed
    tokens_dev: torch.Tensor | None = None  # int64 [B] sampled tokens on the device (None: a greedy graph's launch)
    host: torch.Tensor | None = None  # pinned int64 [B]
    ready: torch.cuda.Event | None = None  # recorded after the copy to `host`
    launch: int = -1  # a greedy graph's launch number (GreedyGraphs.launches before it)
    rng: tuple = ()  # (generator, its state before this step drew) per sampled row: restored if the step is dropped
    logprobs: tuple | None = None  # (rows asking, pinned chosen [R], top values [R, k], top ids [R, k])
    logits: torch.Tensor | None = None  # f32 [B, V], a deferred step's own copy: sampled when it is consumed


def _sampled_when_queued(s) -> bool:
    """Whether a step of sequence s may be sampled before the step before it is read back: nothing its sampling
    reads changes with that token in a way the device cannot follow. A logit bias and the sampling parameters are
    fixed; penalty counts take the token in flight on the device, and min_tokens' ban counts it as out
    (sampler.penalized_logits' `pending`); logprobs are computed on the device with the token. A grammar's mask
    needs its matcher to have consumed that token on the host: such a batch's steps are deferred."""
    return s.grammar is None


def _greedy_graph_ok(s) -> bool:
    """Whether the greedy graphs (raw argmax, no logits kept) give sequence s's token and all it asks for."""
    return s.plain_greedy and s.params.logprobs is None


class DecodeLookahead:
    """Decode with one step in flight ahead (see the module docstring)."""

    def __init__(self, engine, runner: CudaGraphRunner, graph_io: bool | None = None):
        self.engine = engine
        self.runner = runner
        if graph_io is None:
            graph_io = os.environ.get("EXL2_BACKEND_GRAPH_IO", "1") != "0"
        self.graphs = None
        if graph_io:
            from exl2_backend.runtime.greedy_graphs import GreedyGraphs

            try:
                self.graphs = GreedyGraphs(runner)
            except Exception as exc:  # noqa: BLE001 - the plain graph steps are a correct fallback
                log.warning("exl2_backend: greedy graphs with host I/O unavailable (%s); plain graph steps", exc)
            else:
                self.graphs.capture_all()
        n = runner.buckets[-1]
        self._host = [torch.zeros(n, dtype=torch.int64).pin_memory() for _ in range(2)]  # ping-pong
        self._flip = 0
        self._ahead: _Flight | None = None
        self.steps_ahead_used = 0  # stats: lookahead steps consumed / dropped
        self.steps_ahead_dropped = 0
        self.sampled_steps = 0  # stats: steps with a sampled row (plain graph steps)
        self.deferred_steps = 0  # stats: steps sampled when consumed (a grammar's batch)

    @staticmethod
    def supports(runner) -> bool:
        return type(runner) is CudaGraphRunner

    def eligible(self, seqs) -> bool:
        return 0 < len(seqs) <= self.runner.buckets[-1]

    def drop(self) -> None:
        """Forget the queued step (its GPU work completes harmlessly; its generator draws are undone)."""
        if self._ahead is not None:
            self._discard(self._ahead)
        self._ahead = None

    def _discard(self, flight: _Flight) -> None:
        for g, state in flight.rng:
            g.set_state(state)
        self.steps_ahead_dropped += 1

    def _enqueue(self, seqs: tuple, prev: _Flight | None) -> _Flight:
        """Queue the decode step at position num_tokens - 1 of each sequence, its inputs their last tokens; or,
        after `prev` (the flight at that position), the next one, its inputs prev's tokens still on the device."""
        r, b = self.runner, len(seqs)
        offset = 0 if prev is None else 1
        starts = [s.num_tokens - 1 + offset for s in seqs]
        for s, p in zip(seqs, starts):
            self.engine.pages.grow(s, p + 1)
        expect = tuple(s.num_tokens + offset for s in seqs)
        bucket = next(x for x in r.buckets if x >= b)
        # a step after `prev` takes prev's path (its token is where that path left it); a fresh one the greedy
        # graphs when they are on and capture
        if prev is not None:
            on_graph = prev.launch >= 0
        else:
            on_graph = (self.graphs is not None and self.graphs.ready(bucket)
                        and all(_greedy_graph_ok(s) for s in seqs))
        if on_graph:
            n = self.graphs.launches
            if prev is not None and prev.launch != n - 1:  # the graph reads the last launch's tokens
                raise RuntimeError(f"lookahead: greedy graph launch {n} would read launch {n - 1}, not its "
                                   f"input flight's ({prev.launch})")
            tokens = [FROM_PREVIOUS if prev is not None else s.last_token for s in seqs]
            host, ready = self.graphs.launch(tokens, starts, [s.pages for s in seqs])
            return _Flight(seqs, expect, None, host, ready, n)
        tokens = [[s.last_token] for s in seqs]  # offset 1: placeholders, overwritten on the device below
        r._upload(tokens, starts, [s.pages for s in seqs], bucket)
        if prev is not None:
            r._stage_dev[:b, 0].copy_(prev.tokens_dev)  # stream-ordered after the staging upload
        r._graphs[bucket].replay()
        r.replays += 1
        logits = r._outputs[bucket][:b]  # [B, V]
        flight = _Flight(seqs, expect)
        if all(_sampled_when_queued(s) for s in seqs):  # prev's tokens are not yet in the host's counts: pending
            self._sample(flight, logits, None if prev is None else prev.tokens_dev)
        else:  # sampled when consumed; a copy, since a 1-token prefill chunk may replay this graph meanwhile
            flight.logits = logits.clone()
            self.deferred_steps += 1
        return flight

    def _sample(self, flight: _Flight, logits: torch.Tensor, pending: torch.Tensor | None) -> None:
        """Sample `flight` from its logits [B, V] as eager decoding does, its tokens copied to pinned memory behind
        the sampler (and its logprobs), with the generators' states before the draw kept for a drop."""
        seqs, b = flight.seqs, len(flight.seqs)
        sampled = [s.generator for s in seqs if s.params.sampling.temperature != 0]
        flight.rng = tuple((g, g.get_state()) for g in sampled)
        flight.tokens_dev = sample_on_device(list(seqs), logits, pending)  # [B]
        self.sampled_steps += bool(sampled)
        flight.host = self._host[self._flip][:b]
        self._flip ^= 1
        flight.host.copy_(flight.tokens_dev, non_blocking=True)
        flight.logprobs = self._logprobs(seqs, logits, flight.tokens_dev)
        flight.ready = torch.cuda.Event()
        flight.ready.record()
        flight.logits = None

    @staticmethod
    def _logprobs(seqs: tuple, logits: torch.Tensor, tok: torch.Tensor) -> tuple | None:
        """The logprobs of the rows asking for them (Engine._logprobs_for's, computed the same way on the same
        rows), copied into pinned memory behind the tokens: (rows, chosen [R], top values [R, k], top ids [R, k])."""
        rows = [i for i, s in enumerate(seqs) if s.params.logprobs is not None]
        if not rows:
            return None
        idx = to_device(rows, torch.int64, logits.device)
        ids = tok.index_select(0, idx).clamp_min(0)  # a NaN row's -1: its entry is never read (the sequence fails)
        out = logprob_tensors(logits.index_select(0, idx), ids, max(seqs[i].params.logprobs for i in rows))
        pinned = tuple(torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in out)
        for h, t in zip(pinned, out):
            h.copy_(t, non_blocking=True)
        return (rows, *pinned)

    def decode(self, seqs: list) -> list:
        """One token per sequence (StepEvents, as Engine.decode)."""
        key = tuple(seqs)
        ahead, self._ahead = self._ahead, None
        if ahead is not None and ahead.seqs == key and ahead.expect == tuple(s.num_tokens for s in seqs):
            flight = ahead
            self.steps_ahead_used += 1
        else:
            if ahead is not None:
                self._discard(ahead)  # before the fresh step draws from the same generators
            flight = self._enqueue(key, None)
        if flight.logits is not None:  # deferred: the host's state (grammar matchers) is current now
            self._sample(flight, flight.logits, None)
        if all(s.remaining_new_tokens >= 2 for s in seqs):
            self._ahead = self._enqueue(key, flight)
        flight.ready.synchronize()
        tokens = flight.host.tolist()
        lps = {}
        if flight.logprobs is not None:
            rows, chosen, top_vals, top_ids = flight.logprobs
            got = entries_from([tokens[i] for i in rows], chosen.tolist(), top_vals.tolist(), top_ids.tolist(),
                               [seqs[i].params.logprobs for i in rows])
            lps = {i: lp for i, lp in zip(rows, got) if tokens[i] != NAN_LOGITS}
        events = []
        for i, (s, t) in enumerate(zip(seqs, tokens)):
            s.num_computed += 1
            events.append(self.engine._emit_sampled(s, t, lps.get(i)))  # a NaN row's token fails its sequence
        if any(s.finished for s in seqs):
            self.drop()
        return events
