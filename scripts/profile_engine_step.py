#!/usr/bin/env python3
"""Where a batch-1 engine decode step spends its time beyond the CUDA-graph replay.

`bench` reports two decode figures: the engine's (`Engine.decode` per token: staging upload, graph replay, the
greedy argmax, the readback, Python bookkeeping; greedy steps keep one step in flight, runtime/lookahead.py) and
the graph's alone (back-to-back replays). H200 call AK3 of 2026-12-04: 423.9 against 433.6 tok/s for the 8B at 1k,
53 us per step. This runs --steps engine decode steps under torch.profiler and splits each step's wall time into
GPU busy time (the union of kernel, memcpy and memset intervals) and idle time, lists the GPU work per step by
name (what runs besides the model's kernels), and the largest idle gaps by the names of the activities around
them. On a CPU there is no device trace: only the host time per decode call.

    python scripts/profile_engine_step.py --shape llama3-8b --context 1024 --json engine_step.json
"""

from __future__ import annotations

import argparse
import collections
import json
import time
from pathlib import Path

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

from exl2_backend.bench.decode import add_model_args, load_engine, load_model, model_dir_from_args, prefill_seconds


def device_intervals(prof) -> list[tuple[float, float, str]]:
    """(start us, end us, name) of every device activity of the trace, by start."""
    spans = [(e.time_range.start, e.time_range.end, e.name) for e in prof.events()
             if e.device_type == DeviceType.CUDA and e.time_range.end > e.time_range.start]
    return sorted(spans)


def busy_and_gaps(spans: list[tuple[float, float, str]], min_gap_us: float = 1.0):
    """(wall us, busy us: the union of the intervals, gaps: (us, name before, name after) of every idle stretch
    longer than min_gap_us) over the intervals sorted by start."""
    if not spans:
        return 0.0, 0.0, []
    busy, gaps = 0.0, []
    cur_start, cur_end, cur_name = spans[0]
    for start, end, name in spans[1:]:
        if start > cur_end:
            busy += cur_end - cur_start
            if start - cur_end > min_gap_us:
                gaps.append((start - cur_end, cur_name, name))
            cur_start, cur_end, cur_name = start, end, name
        elif end > cur_end:
            cur_end, cur_name = end, name
    busy += cur_end - cur_start
    return spans[-1][1] - spans[0][0], busy, gaps


def summarize(spans, steps: int, top: int) -> dict:
    """Per-step figures of a trace of `steps` decode steps: wall / busy / idle us, the device work by name (count
    and us per step) and the largest idle gaps grouped by the names around them."""
    wall, busy, gaps = busy_and_gaps(spans)
    by_name: dict[str, list[float]] = collections.defaultdict(lambda: [0, 0.0])
    for start, end, name in spans:
        by_name[name][0] += 1
        by_name[name][1] += end - start
    work = sorted(({"name": n, "per_step": c / steps, "us_per_step": us / steps} for n, (c, us) in by_name.items()),
                  key=lambda r: -r["us_per_step"])
    pairs: dict[tuple[str, str], list[float]] = collections.defaultdict(lambda: [0, 0.0])
    for us, before, after in gaps:
        pairs[(before, after)][0] += 1
        pairs[(before, after)][1] += us
    gap_rows = sorted(({"before": b, "after": a, "per_step": c / steps, "us_per_step": us / steps}
                       for (b, a), (c, us) in pairs.items()), key=lambda r: -r["us_per_step"])
    return {"steps": steps, "wall_us_per_step": wall / steps, "busy_us_per_step": busy / steps,
            "idle_us_per_step": (wall - busy) / steps, "work": work[:top], "gaps": gap_rows[:top]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_args(ap, "/tmp/models")
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--top", type=int, default=15)
    ap.add_argument("--json", help="write the summary here")
    args = ap.parse_args()

    model_dir = model_dir_from_args(args)
    loaded = load_model(model_dir, args.device)
    engine, _, _ = load_engine(model_dir, args.device, args.context + 2 * args.steps + 64, use_graphs=True,
                               loaded=loaded)
    on_gpu = engine.device.type == "cuda"
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, engine.config.vocab_size, (args.context,), generator=gen).tolist()
    prefill_seconds(engine, "seq", prompt, 2 * args.steps + 16)
    for _ in range(4):
        engine.decode(["seq"])
    if on_gpu:
        torch.cuda.synchronize(engine.device)
    t0 = time.perf_counter()
    for _ in range(args.steps):
        engine.decode(["seq"])
    if on_gpu:
        torch.cuda.synchronize(engine.device)
    host_step = (time.perf_counter() - t0) / args.steps
    result = {"model_dir": str(model_dir), "context": args.context, "device": str(engine.device),
              "engine_step_us": host_step * 1e6}
    if on_gpu:
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(args.steps):
                engine.decode(["seq"])
            torch.cuda.synchronize(engine.device)
        result["trace"] = summarize(device_intervals(prof), args.steps, args.top)
    engine.release("seq")
    engine.assert_no_leaks()
    print(f"engine decode step {host_step * 1e6:.1f} us at context {args.context} ({engine.device})")
    trace = result.get("trace")
    if trace:
        print(f"under the profiler, per step: wall {trace['wall_us_per_step']:.1f} us, GPU busy "
              f"{trace['busy_us_per_step']:.1f}, idle {trace['idle_us_per_step']:.1f}")
        print("device work per step (count, us):")
        for r in trace["work"]:
            print(f"  {r['per_step']:6.2f} {r['us_per_step']:9.2f}  {r['name'][:100]}")
        print("idle gaps per step (count, us): before -> after")
        for r in trace["gaps"]:
            print(f"  {r['per_step']:6.2f} {r['us_per_step']:9.2f}  {r['before'][:50]} -> {r['after'][:50]}")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
