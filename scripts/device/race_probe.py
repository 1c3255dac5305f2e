"""What the varying GEMV launches read or leave unwritten (BD19: the 8B layer's gated down GEMV at M = 2 differs
between identical runs in most repeats, the norm-fused gate/up now and then; with PDL off and with
CUDA_LAUNCH_BLOCKING=1 too, so inside one launch). A device-call diagnostic: each probe repeats one GEMV on fixed
inputs and compares with its first result, optionally with the split-K partials filled with NaN before every
launch (a launch that sums a partial it did not write this time then shows NaN) and with NaN left in the memory the
output is allocated from (an element no block writes then shows NaN). Per probe: repeats that differ, repeats with
NaN, the column blocks (256 columns) and rows that differ, the largest difference, tickets left armed.

    python3 scripts/device/race_probe.py --iters 1500 --tag default
"""

from __future__ import annotations

import argparse
import json

import torch

from tests.kernels.tma_gemv import rand_half


def _probes():
    from exl2_backend import ops
    from exl2_backend.model.layers import norm_linear
    from exl2_backend.ops import cuda_quant
    from tests.kernels import test_gemv_chain as t

    o, gate_up, down, _ = t._llama3_8b_layer()
    gu = {m: rand_half((m, 2 * 14336), 40 + m, 2.0) for m in (1, 2, 5)}
    inner2 = ops.silu_mul(gu[2][:, :14336], gu[2][:, 14336:]).contiguous()  # the ungated input at M = 2
    h = {m: rand_half((m, 4096), 50 + m) for m in (1, 2)}
    res = {m: rand_half((m, 4096), 60 + m, 4.0) for m in (1, 2)}
    w = rand_half((4096,), 70, 0.3) + 1

    def splits(mode, fn):  # fn under GEMV_SPLITS = mode
        def run():
            cuda_quant.GEMV_SPLITS = mode
            return fn()
        return run

    def span(fn):
        return splits("span", fn)

    probes = {}
    for m in (1, 2, 5):
        probes[f"down_gated_m{m}"] = span(lambda m=m: down.gated(gu[m]))
    probes["down_gated_m2_balanced"] = splits("balanced", lambda: down.gated(gu[2]))
    probes["down_plain_m2"] = span(lambda: down.fused_kernel(inner2, "gemv"))
    probes["o_m2"] = span(lambda: o.fused_kernel(h[2], "gemv"))
    for m in (1, 2):
        probes[f"gate_up_norm_m{m}"] = span(lambda m=m: norm_linear(gate_up, h[m], res[m], w, t.EPS)[0])
    def down_reference(m):  # fp32 silu(gate) * up @ W, W dequantized by the library (input order)
        w_full = down.launch.dequant(0, 0, down.out_features).float()
        g, u = gu[m][:, :14336].float(), gu[m][:, 14336:].float()
        return (torch.nn.functional.silu(g) * u) @ w_full

    refs = {"down_gated_m2": lambda: down_reference(2), "down_gated_m2_balanced": lambda: down_reference(2),
            "down_gated_m1": lambda: down_reference(1)}
    return probes, {"down": down, "gate_up": gate_up}, refs


def _tiles(diff: torch.Tensor) -> dict[int, list[int]]:
    """Differing 32-column warp tiles per row."""
    return {r: (diff[r].nonzero().flatten() // 32).unique().tolist() for r in range(diff.shape[0])}


def _run(name, fn, iters: int, ws_nan: bool, out_nan: bool, ref=None):
    from exl2_backend.ops import cuda_quant

    wsp = cuda_quant.workspace(torch.device("cuda"))
    first = fn().clone()
    torch.cuda.synchronize()
    stat = {"iters": iters, "differ": 0, "nan": 0, "max_abs": 0.0, "colblocks": {}, "rows": {}, "armed_tickets": 0,
            "examples": []}
    if ref is not None:  # how far the first result and the differing ones are from the fp32 reference
        stat["first_err"] = float((first.float() - ref).abs().max())
        stat["other_err"] = 0.0
    for _ in range(iters):  # bounded
        if ws_nan:
            wsp.ws.fill_(float("nan"))
        if out_nan:  # the caching allocator hands this block to the output next
            junk = torch.full_like(first, float("nan"))
            del junk
        y = fn()
        armed = int(wsp.counters.count_nonzero())
        stat["armed_tickets"] += armed > 0
        nan = torch.isnan(y)
        stat["nan"] += bool(nan.any())
        diff = (y != first) | nan
        if bool(diff.any()):
            stat["differ"] += 1
            finite = ~nan
            if bool(finite.any()):
                stat["max_abs"] = max(stat["max_abs"], float(((y.float() - first.float()).abs() * finite).max()))
            if len(stat["examples"]) < 4:
                stat["examples"].append(_tiles(diff))
            if ref is not None:
                stat["other_err"] = max(stat["other_err"], float((y.float() - ref).abs().max()))
            rows, cols = diff.nonzero(as_tuple=True)
            for c in (cols // 256).unique().tolist():
                stat["colblocks"][c] = stat["colblocks"].get(c, 0) + 1
            for r in rows.unique().tolist():
                stat["rows"][r] = stat["rows"].get(r, 0) + 1
    stat["colblocks"] = dict(sorted(stat["colblocks"].items())[:40])
    return stat


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--iters", type=int, default=1500)
    ap.add_argument("--tag", default="default")
    ap.add_argument("--no-nan", action="store_true", help="skip the NaN-filled repeats")
    ap.add_argument("--only", default="", help="comma-separated probe names (default: all)")
    args = ap.parse_args()
    probes, linears, refs = _probes()
    from exl2_backend.ops import cuda_quant

    for m in (1, 2, 5):
        for lname, lin in linears.items():
            cuda_quant.GEMV_SPLITS = "span"
            pl = lin.launch.gemv_plan(m)
            print(f"plan {lname} m={m}: ksplit {pl.ksplit}, splits {lin.launch.gemv_splits(m)}, "
                  f"pregathers {lin.launch.pregathers(m)}", flush=True)
    only = set(filter(None, args.only.split(",")))
    out = {}
    for name, fn in probes.items():
        if only and name not in only:
            continue
        for ws_nan, out_nan in ((False, False), (True, True))[: 1 if args.no_nan else 2]:
            key = f"{name}{'/nan' if ws_nan else ''}"
            ref = refs[name]() if name in refs else None
            out[key] = _run(name, fn, args.iters, ws_nan, out_nan, ref)
            print(key, json.dumps(out[key]), flush=True)
    print(json.dumps({"tag": args.tag, "probes": out}), flush=True)


if __name__ == "__main__":
    main()
