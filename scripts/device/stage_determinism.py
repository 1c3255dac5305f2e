"""Which launch of a decoder layer's GEMVs varies between identical runs? (BD18: the launches one by one, o ->
gate/up (norm) -> down (gated) -> q/k/v (norm), gave outputs that differ from their own first run, alone on the
GPU, up to thousands of elements; the opt-in chain over the same GEMVs never did.) A device-call diagnostic: each
case repeats the layer for a bounded time and reports, per stage, the repeats that differ from the first run and
from the run before, the largest difference, and how many distinct final outputs it saw. Run it once per
configuration (EXL2_BACKEND_PDL=0, CUDA_LAUNCH_BLOCKING=1, --sync-stages) to tell launch overlap from a race
inside one kernel.

    python3 scripts/device/stage_determinism.py --seconds 4 --tag default
"""

from __future__ import annotations

import argparse
import hashlib
import json
import time

import torch


def _stages(layer, data, sync: bool):
    """The launches of tests/kernels/test_gemv_chain._one_by_one, each stage's outputs kept."""
    from exl2_backend.model.layers import norm_linear
    from tests.kernels import test_gemv_chain as t

    o, gate_up, down, qkv = layer
    x, residual, post_w, next_w = data
    out = {}
    out["o"] = o.fused_kernel(x, "gemv")
    if sync:
        torch.cuda.synchronize()
    out["gate_up"], out["residual1"] = norm_linear(gate_up, out["o"], residual, post_w, t.EPS)
    if sync:
        torch.cuda.synchronize()
    out["down"] = down.gated(out["gate_up"])
    if sync:
        torch.cuda.synchronize()
    out["qkv"], out["residual2"] = norm_linear(qkv, out["down"], out["residual1"], next_w, t.EPS)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=float, default=4.0, help="repeats per case and split mode")
    ap.add_argument("--tag", default="default")
    ap.add_argument("--sync-stages", action="store_true", help="synchronize the device between stages")
    args = ap.parse_args()
    from exl2_backend.ops import cuda_quant
    from tests.kernels import test_gemv_chain as t

    big = t._llama3_8b_layer()
    mid = t._layer(2048, 8192, 2048, 512, (8, 5, 4), seed=11)
    cases = [("8b-m1", big, 1), ("8b-m2", big, 2), ("8b-m5", big, 5), ("2048-m4", mid, 4)]
    report = {}
    for name, layer, m in cases:
        data = t._layer_inputs(layer[0], m, 5)
        for splits in ("span", "balanced"):
            cuda_quant.GEMV_SPLITS = splits
            first = _stages(layer, data, args.sync_stages)  # fresh tensors every run: kept, not copied
            prev = first
            rows = {k: {"vs_first": 0, "vs_previous": 0, "max_abs": 0.0} for k in first}
            finals, runs = set(), 0
            deadline = time.monotonic() + args.seconds
            while time.monotonic() < deadline:  # bounded: stops at the deadline
                cur = _stages(layer, data, args.sync_stages)
                runs += 1
                for k, v in cur.items():
                    r = rows[k]
                    r["vs_first"] += not torch.equal(v, first[k])
                    r["vs_previous"] += not torch.equal(v, prev[k])
                    r["max_abs"] = max(r["max_abs"], float((v.float() - first[k].float()).abs().max()))
                finals.add(hashlib.sha1(cur["qkv"].cpu().numpy().tobytes()).hexdigest())
                prev = cur
            varied = {k: v for k, v in rows.items() if v["vs_first"] or v["vs_previous"]}
            report[f"{name}/{splits}"] = {"runs": runs, "distinct_final": len(finals), "stages": varied}
            print(name, splits, json.dumps(report[f"{name}/{splits}"]), flush=True)
    print(json.dumps({"tag": args.tag, "report": report}), flush=True)


if __name__ == "__main__":
    main()
