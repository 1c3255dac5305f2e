"""A few eager launches of one 8B-shape layer's GEMV chain and of the launches it replaces, for ncu (a device-call
diagnostic): `ncu -k regex:gemv_chain --launch-skip 3 --launch-count 1 python3 scripts/chain_once.py`.

    python3 scripts/chain_once.py [--m 1] [--reps 5]
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--m", type=int, default=1)
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    from chain_bench import build

    from exl2_backend.model.layers import norm_linear
    from exl2_backend.ops import cuda_chain

    dev = torch.device("cuda")
    config, (layer, nxt) = build(dev)
    eps = config.rms_norm_eps
    g = torch.Generator(device=dev).manual_seed(args.m)
    x = torch.randn(args.m, config.hidden_size, generator=g, device=dev).half()
    residual = torch.randn(args.m, config.hidden_size, generator=g, device=dev).half()
    cuda_chain.GEMV_CHAIN = True
    for _ in range(args.reps):
        gu, r1 = norm_linear(layer.gate_up, layer.o(x), residual, layer.post_norm, eps)
        norm_linear(nxt.qkv, layer.down.gated(gu), r1, nxt.input_norm, eps)
        cuda_chain.mlp_chain(layer.o, layer.gate_up, layer.down, nxt.qkv, x, residual, layer.post_norm,
                             nxt.input_norm, eps)
    torch.cuda.synchronize()
    print("done")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
