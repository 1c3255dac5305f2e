"""Which side of the opt-in GEMV chain's test varies (BD11 / BD15 / BD16: chain tests 1-2 fp16 ulps off the launches
one by one, only after other tests ran in the same process): a pytest file for a device call, run after the tests
that preceded BD16's failure, in one process. It repeats BD16's failing case (the 2048 / 8192 layer, M = 4, the
chain's grid capped at one block) three times each way, with three phases (o, gate/up, down) and with four (the next
q/k/v too), and prints how many elements differ between every two runs (a device-call diagnostic, not collected by
the test suite).

    python3 -m pytest -p no:xdist -s <the preceding test ids> scripts/device/debug_chain_order.py
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.cuda


def test_repeat_the_failing_case(monkeypatch):
    from exl2_backend.ops import cuda_chain, cuda_quant
    from tests.kernels import test_gemv_chain as t

    monkeypatch.setattr(cuda_chain, "GEMV_CHAIN", True)
    monkeypatch.setattr(cuda_quant, "GEMV_SPLITS", "balanced")
    monkeypatch.setattr(cuda_chain, "MAX_GRID", 1)
    monkeypatch.setattr(cuda_chain, "NORM_PHASES", "auto")
    o, gate_up, down, qkv = t._layer(2048, 8192, 2048, 512, (8, 5, 4), seed=11)
    m, seed = 4, 4 + 7 * 1
    x, residual, post_w, next_w = t._layer_inputs(o, m, seed)
    for nxt, w in ((None, None), (qkv, next_w)):  # three phases (down's output), then four (the next q/k/v)
        runs = {}
        for i in range(3):
            runs[f"launches{i}"] = t._one_by_one(o, gate_up, down, nxt, x, residual, post_w, w)[0]
            runs[f"chain{i}"] = cuda_chain.mlp_chain(o, gate_up, down, nxt, x, residual, post_w, w, t.EPS)[0]
        torch.cuda.synchronize()
        names = list(runs)
        print(f"{3 if nxt is None else 4} phases: elements that differ between runs", flush=True)
        for a in names:
            print(a, " ".join(f"{b}:{int((runs[a] != runs[b]).sum())}" for b in names), flush=True)
