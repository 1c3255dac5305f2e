"""L2 lookahead between consecutive GEMVs (csrc/quant/exl2_gemv_lookahead.cu).

Every small-M GEMV launch spends microseconds that move no weights: its tail (the ring draining, the split-K
finish) and the next launch's start (PDL release, constants, the input gather). Linked here, a linear op's GEMV
prefetches the first weight bytes of the op launched after it into L2 as its blocks finish streaming, so the
DRAM keeps streaming across the boundary. A prefetch is a hint: outputs are the same bits with or without it.

EXL2_BACKEND_GEMV_LOOKAHEAD_MB sets the weight bytes prefetched per link (0: off).
"""

from __future__ import annotations

import ctypes
import os

import numpy as np
import torch

from exl2_backend.ops import library
from exl2_backend.ops.cuda_quant import CudaLinearOp, _fn, _Launch

LOOKAHEAD_BYTES = int(float(os.environ.get("EXL2_BACKEND_GEMV_LOOKAHEAD_MB", "0")) * (1 << 20))
_MAX_RANGES = 256  # kMaxLookaheadRanges of csrc/quant/exl2_gemv.cuh


def lookahead_ranges(target: _Launch, budget: int) -> np.ndarray:
    """int64 [n, 2] (device address, bytes) of what a launch before `target` prefetches: target's chunk info,
    act-order map and scales, then the first bytes of each of its one-row launch's splits, `budget` bytes shared
    by split size (launches of more rows may split further; the prefetch stays a hint)."""
    blob = target.gemv_plan(1).blob
    out = np.zeros((_MAX_RANGES, 2), dtype=np.int64)
    count = ctypes.c_int(0)
    st = _fn("exl2_gemv_lookahead_ranges")(blob.ctypes.data, len(target.parts), int(budget), out.ctypes.data,
                                           _MAX_RANGES, ctypes.addressof(count))
    library.check(st, "exl2_gemv_lookahead_ranges")
    return out[: count.value].copy()


def set_lookahead(op: CudaLinearOp, target: CudaLinearOp | None, budget: int) -> bool:
    """op's GEMV launches prefetch `target`'s first `budget` weight bytes into L2 (None or budget <= 0: nothing).
    Both must be on one device. Returns whether a lookahead is set."""
    launch = op.launch
    launch.lookahead_fields, launch.lookahead, launch.lookahead_target = (0, 0, 0), None, None
    if target is None or budget <= 0:
        return False
    if target.launch.device != launch.device:
        raise ValueError(f"lookahead across devices ({launch.device} -> {target.launch.device})")
    ranges = lookahead_ranges(target.launch, budget)
    if not len(ranges):
        return False
    # [n, 2] on the device, kept alive by the launch (its address is in every descriptor blob); the target's
    # weights are kept alive with it
    launch.lookahead = torch.from_numpy(ranges).to(launch.device)
    launch.lookahead_target = target.launch
    launch.lookahead_fields = (launch.lookahead.data_ptr(), len(ranges), int(ranges[:, 1].sum()))
    return True


def link_lookahead(linears: list, budget: int | None = None) -> int:
    """Links each CudaLinearOp of `linears` (in launch order) to the next one on the same device; other ops
    and device changes break the chain. budget: bytes per link (default EXL2_BACKEND_GEMV_LOOKAHEAD_MB). Returns
    the links set."""
    budget = LOOKAHEAD_BYTES if budget is None else budget
    links = 0
    for op, nxt in zip(linears, linears[1:]):
        if isinstance(op, CudaLinearOp):
            same = isinstance(nxt, CudaLinearOp) and nxt.launch.device == op.launch.device
            links += set_lookahead(op, nxt if same else None, budget)
    return links
