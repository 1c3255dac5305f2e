"""Do the GEMV launches or the opt-in chain vary when other processes share the GPU? (BD11 / BD15 / BD16: one chain
test 1-2 fp16 ulps off the launches in `-n 8` GPU runs; BD12 / BD17: never in one process alone.) A device-call
diagnostic: run several copies at once; each repeats layer cases for a bounded time and counts the repeats whose
output differs from its own first run, for three sides: the launches as the default decode routes them (span
splits), the launches with per-run splits (what the chain tests compare against) and the chain.

    for i in $(seq 8); do python3 scripts/device/determinism_under_contention.py --seconds 40 --tag $i & done; wait

BD18 ran it alone (the launches varied, the chain did not: enough to move on to stage_determinism.py); its eight
concurrent copies hit the call's 200 s limit while packing the 8B layer and printed nothing.
"""

from __future__ import annotations

import argparse
import json
import time

import torch


def _cases():
    from tests.kernels import test_gemv_chain as t

    big = t._llama3_8b_layer()  # the 8B layer of test_chain_llama3_8b_layer
    mid = t._layer(2048, 8192, 2048, 512, (8, 5, 4), seed=11)  # test_chain_blocks_loop_over_work_items
    return [("8b-m1", big, 1, 0), ("8b-m2", big, 2, 0), ("8b-m5", big, 5, 0), ("2048-m4-grid1", mid, 4, 1),
            ("2048-m4", mid, 4, 0)]


def _side_output(side: str, layer, m: int, grid: int, data):
    from exl2_backend.ops import cuda_chain, cuda_quant
    from tests.kernels import test_gemv_chain as t

    o, gate_up, down, qkv = layer
    cuda_quant.GEMV_SPLITS = "span" if side == "launches_span" else "balanced"
    cuda_chain.MAX_GRID = grid
    x, residual, post_w, next_w = data
    if side == "chain":
        out = cuda_chain.mlp_chain(o, gate_up, down, qkv, x, residual, post_w, next_w, t.EPS)
    else:
        out = t._one_by_one(o, gate_up, down, qkv, x, residual, post_w, next_w)
    return torch.cat([out[0].flatten(), out[1].flatten()])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=float, default=40.0)
    ap.add_argument("--tag", default="0")
    args = ap.parse_args()
    from exl2_backend.ops import cuda_chain
    from tests.kernels import test_gemv_chain as t

    cuda_chain.GEMV_CHAIN, cuda_chain.NORM_PHASES = True, "auto"
    sides = ("launches_span", "launches_balanced", "chain")
    cases = _cases()
    baselines, stats = {}, {}
    for name, layer, m, grid in cases:
        data = t._layer_inputs(layer[0], m, 5)
        for side in sides:
            if side == "chain" and not cuda_chain.chain_takes(*layer, m):
                continue
            baselines[name, side] = (data, _side_output(side, layer, m, grid, data).clone())
            stats[f"{name}/{side}"] = {"runs": 0, "differing_runs": 0, "max_elements": 0}
    deadline = time.monotonic() + args.seconds
    while time.monotonic() < deadline:  # bounded: stops at the deadline
        for name, layer, m, grid in cases:
            for side in sides:
                if (name, side) not in baselines:
                    continue
                data, want = baselines[name, side]
                got = _side_output(side, layer, m, grid, data)
                diff = int((got != want).sum())
                s = stats[f"{name}/{side}"]
                s["runs"] += 1
                s["differing_runs"] += diff > 0
                s["max_elements"] = max(s["max_elements"], diff)
    print(json.dumps({"tag": args.tag, "stats": stats}), flush=True)


if __name__ == "__main__":
    main()
