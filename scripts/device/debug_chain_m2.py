"""Why the opt-in GEMV chain's 8B-layer test fails at M = 2 (BD11, H100): tests/kernels/test_gemv_chain.py's layer
and data, the chain against the launches one by one at M = 1, 2 and 8, with and without the next q/k/v phase, each
path run twice (is either nondeterministic?), and the largest difference of every output (a device-call
diagnostic).

    python3 scripts/device/debug_chain_m2.py
"""

from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def main() -> None:
    from exl2_backend.ops import cuda_chain, cuda_quant
    from tests.kernels import test_gemv_chain as t

    cuda_chain.GEMV_CHAIN = True
    cuda_quant.GEMV_SPLITS = "balanced"
    cuda_chain.NORM_PHASES = "auto"
    o, gate_up, down, qkv = t._llama3_8b_layer()
    for m in (1, 2, 8):
        for nxt in (None, qkv):
            x, residual, post_w, next_w = t._layer_inputs(o, m, m + 30)
            nw = None if nxt is None else next_w
            want = [t._one_by_one(o, gate_up, down, nxt, x, residual, post_w, nw) for _ in range(2)]
            got = [cuda_chain.mlp_chain(o, gate_up, down, nxt, x, residual, post_w, nw, t.EPS) for _ in range(2)]
            torch.cuda.synchronize()

            def diff(a, b):
                return f"{(a.float() - b.float()).abs().max().item():.3g} ({(a != b).sum().item()} differ)"

            print(f"m={m} phases={3 if nxt is None else 4}: out chain vs one-by-one {diff(got[0][0], want[0][0])}, "
                  f"residual {diff(got[0][1], want[0][1])}; one-by-one run 1 vs 2 {diff(want[0][0], want[1][0])}; "
                  f"chain run 1 vs 2 {diff(got[0][0], got[1][0])}", flush=True)
    for name, op in (("o", o), ("gate_up", gate_up), ("down", down), ("qkv", qkv)):
        for m in (1, 2):
            print(name, m, "splits", op.launch.gemv_splits(m), flush=True)


if __name__ == "__main__":
    main()
