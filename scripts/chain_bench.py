"""The persistent GEMV chain (ops/cuda_chain.py) against the launches it replaces, on one 8B-shape layer.

A Llama-3.1-8B layer (random 4.0 bpw weights drawn on the GPU, bench/random_weights.py) runs o_proj -> gate/up
(post-attention norm) -> down (silu_mul) -> the next layer's q/k/v (input norm) for M rows, as a CUDA graph of 16
repetitions replayed 20 times (PDL edges kept), us per repetition:
  apart        the launches one by one (the default path)
  chain        one persistent launch (grid: every resident block)
  chain/132    the same with the grid capped at 132 blocks (one per SM)
  chain/3      o -> gate/up -> down in the chain, the next q/k/v apart (the fourth phase's marginal cost)
EXL2_GEMV_CHAIN_VERBOSE=1 prints the chain's grid and phases once. EXL2_GEMV_CHAIN_STAMPS=1 (four globaltimer
stores per block and phase) adds, per phase, the medians over blocks of: staging the input, consuming the chunks,
finishing (split-K store, ticket, reduce) and waiting at the next barrier, from one eager launch, in us.

    python3 scripts/chain_bench.py [--m 1,5] [--json out.json] [--stamps-out prefix]
"""

from __future__ import annotations

import argparse
import json
import os

import torch

os.environ.setdefault("EXL2_GEMV_CHAIN_VERBOSE", "2")


def build(device):
    from exl2_backend.bench.random_weights import RandomSource
    from exl2_backend.model.layers import DecoderLayer

    src = RandomSource("llama3-8b")
    config = src.config()
    layers = []
    for i, lw in enumerate(src.weights(config, device).layers):
        layers.append(DecoderLayer(i, config, lw, device, torch.float16))
        if len(layers) == 2:
            break
    return config, layers


def captured(fn, reps: int = 16):
    """A CUDA graph of `reps` calls of fn (one warm-up call first: plans and workspaces outside the capture),
    replayed once."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    return graph


def replay_us(graph, reps: int, replays: int = 20) -> float:
    """us per call of a graph of `reps` calls (CUDA events over `replays` replays)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1000 / (reps * replays)


def timed(fn, reps: int = 16, replays: int = 20) -> float:
    return replay_us(captured(fn, reps), reps, replays)


def phase_times(fn, raw_out: str | None = None) -> list[dict]:
    """Per-phase figures (us) of one eager launch's stamps (exl2_gemv_chain_stamps): medians over blocks of the
    steps, the spread of the finishes, and the barrier's own latency (first block through it minus the last
    finish). raw_out: the stamps as a .npy array [blocks, phases, 8] in us from the first start (exl2_gemv_chain.cu's
    kStamps: EXL2_GEMV_CHAIN_STAMPS=2 adds the probe of one L2 round trip after the barrier)."""
    import ctypes

    import numpy as np

    from exl2_backend.ops import library

    fn()
    get = library.declare("exl2_gemv_chain_stamps", library.PTR, library.I32, ctypes.POINTER(ctypes.c_int),
                          ctypes.POINTER(ctypes.c_int))
    buf = np.zeros((1024, 8, 8), dtype=np.uint64)  # [blocks, phases, kStamps]
    grid, nphase = ctypes.c_int(0), ctypes.c_int(0)
    library.check(get(buf.ctypes.data, 1024, ctypes.byref(grid), ctypes.byref(nphase)), "exl2_gemv_chain_stamps")
    stamped = buf[: grid.value, : nphase.value]  # [blocks, phases, 8] ns, 0 where a step was not stamped
    t = stamped.astype(np.float64) / 1000.0
    t -= t[:, 0, 0].min()
    t[stamped == 0] = np.nan  # norm / pregather phases and idle blocks stamp only start and end
    if raw_out:
        np.save(raw_out, t)
    out = []
    for ph in range(nphase.value):
        s = t[:, ph]
        row = {"start_spread": float(np.nanmax(s[:, 0]) - np.nanmin(s[:, 0]))}
        for name, a, b in (("input", 0, 1), ("chunks", 1, 2), ("finish", 2, 3), ("probe_rt", 0, 4),
                           ("loads", 0, 5)):
            d = s[:, b] - s[:, a]
            if np.isfinite(d).any():
                row[name] = float(np.nanmedian(d))
        row["chunks_p90"] = float(np.nanpercentile(s[:, 2] - s[:, 1], 90)) if np.isfinite(s[:, 2]).any() else None
        row["end_median"] = float(np.nanmedian(s[:, 3]))
        row["end"] = float(np.nanmax(s[:, 3]))
        if ph + 1 < nphase.value:
            row["barrier"] = float(np.nanmedian(t[:, ph + 1, 0] - s[:, 3]))
            row["barrier_latency"] = float(np.nanmin(t[:, ph + 1, 0]) - row["end"])
        out.append({k: v for k, v in row.items() if v is not None})
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--m", default="1,5")
    ap.add_argument("--json", default=None)
    ap.add_argument("--stamps-out", default=None, help="prefix of .npy files of the raw stamps, one per M")
    args = ap.parse_args()
    from exl2_backend.model.layers import norm_linear
    from exl2_backend.ops import cuda_chain

    dev = torch.device("cuda")
    config, (layer, nxt) = build(dev)
    eps = config.rms_norm_eps
    results = {}
    for m in [int(v) for v in args.m.split(",")]:
        g = torch.Generator(device=dev).manual_seed(m)
        x = torch.randn(m, config.hidden_size, generator=g, device=dev).half()
        residual = torch.randn(m, config.hidden_size, generator=g, device=dev).half()

        def apart(x=x, residual=residual):
            gu, r1 = norm_linear(layer.gate_up, layer.o(x), residual, layer.post_norm, eps)
            return norm_linear(nxt.qkv, layer.down.gated(gu), r1, nxt.input_norm, eps)

        def chain(x=x, residual=residual):
            return cuda_chain.mlp_chain(layer.o, layer.gate_up, layer.down, nxt.qkv, x, residual, layer.post_norm,
                                        nxt.input_norm, eps)

        def chain3(x=x, residual=residual):
            d, r1 = cuda_chain.mlp_chain(layer.o, layer.gate_up, layer.down, None, x, residual, layer.post_norm, None,
                                         eps)
            return norm_linear(nxt.qkv, d, r1, nxt.input_norm, eps)

        cuda_chain.GEMV_CHAIN = True
        cuda_chain.NORM_PHASES = "auto"  # M = 5 at K = 4096: norm phases (opt-in)
        assert cuda_chain.chain_takes(layer.o, layer.gate_up, layer.down, nxt.qkv, m), f"the chain does not take M={m}"
        want, got = apart(), chain()
        exact = torch.equal(want[0], got[0]) and torch.equal(want[1], got[1])
        row = {"apart_us": timed(apart), "chain_us": timed(chain)}
        cuda_chain.MAX_GRID = 132
        row["chain_grid132_us"] = timed(chain)
        cuda_chain.MAX_GRID = 0
        row["chain3_us"] = timed(chain3)
        row["bit_identical"] = exact
        if os.environ.get("EXL2_GEMV_CHAIN_STAMPS") in ("1", "2"):
            row["phases_us"] = phase_times(chain, args.stamps_out and f"{args.stamps_out}_m{m}.npy")
            for i, ph in enumerate(row["phases_us"]):
                print(f"  M={m} phase {i}: " + ", ".join(f"{k} {v:.2f}" for k, v in ph.items()), flush=True)
        results[f"m{m}"] = row
        print(f"M={m}: " + ", ".join(f"{k} {v:.1f}" if isinstance(v, float) else f"{k} {v}" for k, v in row.items()
                                     if k != "phases_us"), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"gpu": torch.cuda.get_device_name(), "results": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
