"""Where one 8B layer's GEMV launches spend their time at M = 1, under the TMA GEMV's timing probes (a device-call
diagnostic; EXL2_GEMV_PROBE is read once per process, so each probe runs in its own process):

    EXL2_GEMV_PROBE=4 python3 scripts/gemv_probe.py --out probe4.json

A CUDA graph replays `--reps` copies of one layer's four plain GEMVs in decode order (o, gate/up, down, q/k/v; no
fused norm, gate or rope, which the probes exclude) for each MLP width mix among the first four layers of the
random Llama-3.1-8B-shape draw (there, all four have 4-bit MLP weights; the four launches stream 117 MB). Each
launch's duration comes from torch.profiler's trace in launch order; the median over repetitions is printed per
role, with the graph's wall time per layer (CUDA events).

Probes (csrc/quant/exl2_gemv.cuh kProbe*; results are wrong): 1 no activation gather, 2 no split-K ticket or
reduction, 4 no decode or mma (the ring streams and is released). With 4, a role that gets much faster was bound
by its chunk loop's instructions; one that does not, by its memory stream or its fixed costs.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

ROLES = ("o", "gate/up", "down", "q/k/v")


def widths(linear) -> str:
    """The parts' bit widths, as profile_decode labels them ('4:0.1 3:0.9' per part, '|' between parts)."""
    from profile_decode import _op_kind

    return _op_kind(linear)


def launch_durations(graph, reps: int) -> dict[str, float]:
    """Median duration (us) of each role's launches over one replay of the graph (reps x 4 GEMV kernels)."""
    from profile_decode import trace_events

    events = trace_events(graph.replay, 1)
    kernels = sorted((float(e["ts"]), float(e.get("dur", 0.0))) for e in events
                     if e.get("ph") == "X" and e.get("cat") == "kernel" and "gemv" in e.get("name", ""))
    if len(kernels) != 4 * reps:
        raise RuntimeError(f"expected {4 * reps} GEMV kernels in the trace, found {len(kernels)}")
    return {role: round(statistics.median(d for i, (_, d) in enumerate(kernels) if i % 4 == r), 2)
            for r, role in enumerate(ROLES)}


def layer_launches(layer, config, dev):
    """A function that runs the layer's four GEMVs once, in ROLES order, on fixed random M = 1 inputs."""
    g = torch.Generator(device=dev).manual_seed(0)
    x = torch.randn(1, config.hidden_size, generator=g, device=dev).half() * 0.1
    xi = torch.randn(1, config.intermediate_size, generator=g, device=dev).half() * 0.1

    def once():
        layer.o(x)
        layer.gate_up(x)
        layer.down(xi)
        layer.qkv(x)

    return once


def layer_row(layer, config, dev, reps: int, replays: int) -> dict:
    from chain_bench import captured, replay_us

    graph = captured(layer_launches(layer, config, dev), reps)
    row = {"layer_us": round(replay_us(graph, reps, replays), 2)}
    row.update(launch_durations(graph, reps))
    row["mlp_widths"] = widths(layer.gate_up)
    return row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=16)
    ap.add_argument("--replays", type=int, default=20)
    ap.add_argument("--out", help="JSON path (default: stdout only)")
    ap.add_argument("--ncu", action="store_true", help="no graphs or timing: each layer's four launches three "
                    "times eagerly, for `ncu --launch-skip 5 --launch-count 1` (layer 0's second gate/up)")
    args = ap.parse_args()
    from exl2_backend.bench.random_weights import RandomSource
    from exl2_backend.model.layers import DecoderLayer

    dev = torch.device("cuda")
    src = RandomSource("llama3-8b")
    config = src.config()
    rows = {}
    for i, lw in enumerate(src.weights(config, dev).layers):
        if i >= 4:
            break
        layer = DecoderLayer(i, config, lw, dev, torch.float16)
        key = widths(layer.gate_up)
        if args.ncu:
            once = layer_launches(layer, config, dev)
            for _ in range(3):
                once()
            torch.cuda.synchronize()
            print(f"layer {i}: gate/up {key}", flush=True)
            del layer
            continue
        if key not in rows:
            rows[key] = layer_row(layer, config, dev, args.reps, args.replays)
            rows[key]["layer"] = i
        del layer
    result = {"probe": int(os.environ.get("EXL2_GEMV_PROBE", "0") or 0), "layers": list(rows.values())}
    print(json.dumps(result))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
