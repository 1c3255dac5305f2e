"""GPU timing shared by the benchmark scripts and tests/bench: CUDA-graph replays (no launch gaps from Python)."""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable

import torch


def capture_graph(calls: list[Callable[[], object]]) -> torch.cuda.CUDAGraph:
    """All `calls` captured in order into one CUDA graph, after a warm-up run on a side stream (workspace growth,
    kernel attributes); replayed once before it is returned."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for c in calls:
            c()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for c in calls:
            c()
    graph.replay()
    torch.cuda.synchronize()
    return graph


def replay_mean_ms(graph: torch.cuda.CUDAGraph, iters: int, warmup: int = 3) -> float:
    """Mean ms per replay of a captured graph: `warmup` replays, then `iters` back to back between two events (the
    replays' own launch gaps included, as a decode loop pays them)."""
    for _ in range(warmup):
        graph.replay()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(iters):
        graph.replay()
    b.record()
    b.synchronize()
    return a.elapsed_time(b) / iters


def graph_time_us(calls: list[Callable[[], object]], reps: int = 20) -> float:
    """Median µs per call: all `calls` captured once in a CUDA graph, the graph replayed `reps` times, each
    replay timed with events."""
    graph = capture_graph(calls)
    times = [replay_mean_ms(graph, 1, warmup=0) * 1000.0 / len(calls) for _ in range(reps)]
    del graph
    return statistics.median(times)


class GraphRounds:
    """A pytest-benchmark round of GPU work: `calls` captured into one CUDA graph, repeated until one replay takes
    about `min_round_us`, so the host's launch and synchronization (tens of µs, and noisy) stay a few percent of a
    round. Calling it replays once and synchronizes; `us_per_call` is the event-timed median per call and
    `calls_per_round` converts a round's time into it."""

    def __init__(self, calls: list[Callable[[], object]], min_round_us: float = 2000.0, reps: int = 10):
        # calibrated on at least 32 launches: a graph of one short kernel is mostly the graph's own launch
        self.us_per_call = graph_time_us(calls * max(1, math.ceil(32 / len(calls))), reps)
        repeat = max(1, math.ceil(min_round_us / (self.us_per_call * len(calls))))
        self.calls_per_round = repeat * len(calls)
        self._graph = capture_graph(calls * repeat)

    def __call__(self) -> None:
        self._graph.replay()
        torch.cuda.synchronize()
