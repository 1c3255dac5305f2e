"""GPU timing shared by the benchmark scripts: CUDA-graph replay medians (no launch gaps from Python)."""

from __future__ import annotations

import statistics
from collections.abc import Callable

import torch


def graph_time_us(calls: list[Callable[[], object]], reps: int = 20) -> float:
    """Median µs per call: all `calls` captured once in a CUDA graph (after a warm-up on a side stream),
    the graph replayed `reps` times, each replay timed with events."""
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
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1000.0 / len(calls))
    del graph
    return statistics.median(times)
