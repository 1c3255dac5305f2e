"""A decoder layer's GEMV chain in one persistent launch (csrc/quant/exl2_gemv_chain.cu).

After attention a decode step runs four dependent GEMVs per layer: O, gate/up (with the post-attention norm), down
(silu_mul in its gather) and the next layer's q/k/v (with its input norm). Each was its own launch, and each launch
paid a ramp and a tail (~6 us per GEMV on the H200 against 7-16 us of streaming). `exl2_gemv_chain` runs them as
phases of one grid with a grid barrier between them; the next phase's weights stream while the previous phase
finishes. Every phase is the GEMV it replaces, planned the same way, so the outputs are bit-identical.

Op: `exl2_backend::exl2_gemv_chain(x, residual, post_w, next_w, packed, handles, eps, ws!, counters!, barrier!)`
-> (out, residual_out); see `_chain_op`. `mlp_chain` is the model-facing entry: None where the chain does not run
(then the caller runs the ops one by one).
"""

from __future__ import annotations

import os

import numpy as np
import torch

from exl2_backend.errors import TensorShapeError
from exl2_backend.ops import library
from exl2_backend.ops.cuda_quant import (_REG, CudaLinearOp, _check_norm_input, _check_x, _row_stride,
                                         gemv_row_cap)

# EXL2_BACKEND_GEMV_CHAIN=0 launches the four GEMVs one by one (same bits), for A/B timing.
GEMV_CHAIN = os.environ.get("EXL2_BACKEND_GEMV_CHAIN", "1") != "0"
CHAIN_FIELDS = 10  # int64 per phase; csrc/quant/exl2_gemv.cuh kChainFields
MAX_M = 8  # one token tile: the chain kernel instantiates the M <= 8 path only
# > 0 caps the chain's grid (tests: each block then loops over several work items of a phase); 0 = every resident
# block (the occupancy times the SMs, at most the largest phase's work items).
MAX_GRID = 0

_fn = None


def _chain_fn():
    global _fn
    if _fn is None:
        P, I32 = library.PTR, library.I32
        _fn = library.declare("exl2_gemv_chain", P, I32, I32, library.F32, I32, P, library.STREAM)
    return _fn


def chain_takes(o, gate_up, down, nxt, m: int) -> bool:
    """Whether the chain runs M rows through o -> gate_up (normed) -> down (gated) [-> nxt (normed)]: CUDA linears
    on one sm_90+ device whose one-by-one routing would be exactly these launches (the plain TMA GEMV for o and
    down, no pre-gathered input; the norm fused into gate_up and nxt), with matching shapes."""
    ops_ = (o, gate_up, down) + (() if nxt is None else (nxt,))
    if not (GEMV_CHAIN and 1 <= m <= MAX_M and all(isinstance(op, CudaLinearOp) for op in ops_)):
        return False
    if len({op.device for op in ops_}) != 1 or gemv_row_cap(o.device) != 32:
        return False
    hidden = o.out_features
    if gate_up.in_features != hidden or gate_up.out_features != 2 * down.in_features or down.out_features != hidden:
        return False
    if nxt is not None and (nxt.in_features != hidden or not nxt.launch.takes_norm(m)):
        return False
    lo, ld = o.launch, down.launch
    return (lo.takes_gemv(m) and not lo.pregathers(m) and ld.takes_gemv(m) and not ld.pregathers(m)
            and gate_up.launch.takes_norm(m) and len(ld.parts) == 1)


def _row(launch, blob: np.ndarray, x: torch.Tensor, ldx: int, gate_off: int = 0, norm=None) -> list[int]:
    """One phase of the table: the bound descriptors, the input and the fused norm (weight, residual, residual
    out) or none."""
    w, res, res_out = norm if norm is not None else (None, None, None)
    return [blob.ctypes.data, len(launch.parts), x.data_ptr(), ldx, gate_off,
            0 if w is None else w.data_ptr(), 0 if res is None else res.data_ptr(),
            0 if res is None else _row_stride(res), 0 if res_out is None else res_out.data_ptr(),
            0 if res_out is None else res_out.shape[1]]


@torch.library.custom_op("exl2_backend::exl2_gemv_chain", mutates_args=("ws", "counters", "barrier"))
def _chain_op(x: torch.Tensor, residual: torch.Tensor, post_w: torch.Tensor, next_w: torch.Tensor | None,
              packed: torch.Tensor, handles: list[int], eps: float, ws: torch.Tensor, counters: torch.Tensor,
              barrier: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K_o] (the attention output), residual [M, H]; handles: the prepared o, gate_up, down [, next] launches.
    o_out = o(x); (gu, r1) = gate_up(rms_norm(o_out + residual) * post_w), r1 = o_out + residual; d = down(silu(gate)
    * up); with next: (y, r2) = next(rms_norm(d + r1) * next_w) and the result is (y, r2), else (d, r1)."""
    if len(handles) not in (3, 4) or (len(handles) == 4) != (next_w is not None):
        raise TensorShapeError("the chain takes o, gate_up, down and optionally next (with its norm weight)",
                               tensor="handles")
    launches = [_REG[h] for h in handles]
    o, gu, dn = launches[:3]
    nx = launches[3] if len(launches) == 4 else None
    dev = packed.device
    _check_x(x, o.K, dev)
    m, hidden = x.shape[0], o.out_features
    if not 1 <= m <= MAX_M:
        raise TensorShapeError(f"the GEMV chain takes 1..{MAX_M} rows, got {m}", tensor="x")
    _check_norm_input(residual, "residual", hidden, m, dev)
    for name, w in (("post_w", post_w), ("next_w", next_w)):
        if w is not None and (w.shape != (hidden,) or w.dtype != torch.float16 or w.device != dev
                              or not w.is_contiguous() or w.data_ptr() % 16):
            raise TensorShapeError(f"{name} must be a contiguous float16 [{hidden}] tensor on {dev}", tensor=name)
    o_out, b_o = o._bind(o.gemv_plan(m), m, ws, counters, dev)
    gu_out, b_gu = gu._bind(gu.gemv_plan(m), m, ws, counters, dev)
    r1 = x.new_empty((m, hidden))
    d_out, b_d = dn._bind(dn.gemv_plan(m), m, ws, counters, dev)
    rows = [_row(o, b_o, x, _row_stride(x)),
            _row(gu, b_gu, o_out, hidden, norm=(post_w, residual, r1)),
            _row(dn, b_d, gu_out, gu.out_features, gate_off=dn.K)]
    out, res_out = d_out, r1
    if nx is not None:
        out, b_n = nx._bind(nx.gemv_plan(m), m, ws, counters, dev)
        res_out = x.new_empty((m, hidden))
        rows.append(_row(nx, b_n, d_out, hidden, norm=(next_w, r1, res_out)))
    table = np.asarray(rows, dtype=np.int64)
    st = _chain_fn()(table.ctypes.data, len(rows), m, float(eps), MAX_GRID, barrier.data_ptr(),
                     torch.cuda.current_stream(dev).cuda_stream)
    library.check(st, "exl2_gemv_chain")
    return out, res_out


@_chain_op.register_fake
def _(x, residual, post_w, next_w, packed, handles, eps, ws, counters, barrier):
    last = _REG[handles[-1]]
    return x.new_empty((x.shape[0], last.out_features)), x.new_empty((x.shape[0], _REG[handles[0]].out_features))


def mlp_chain(o, gate_up, down, nxt, x: torch.Tensor, residual: torch.Tensor, post_w: torch.Tensor,
              next_w: torch.Tensor | None, eps: float) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(nxt(rms_norm(d + r1) * next_w), d + r1) with d = down(silu_mul(gate_up(rms_norm(o(x) + residual) *
    post_w))) and r1 = o(x) + residual -- or (d, r1) when nxt is None -- in one launch; None where chain_takes says
    no or the inputs are not laid out for it (the caller runs the ops one by one)."""
    m = x.shape[0] if x.dim() == 2 else 0
    if not chain_takes(o, gate_up, down, nxt, m) or (nxt is None) != (next_w is None):
        return None
    if x.stride(-1) != 1 or residual.dim() != 2 or residual.stride(-1) != 1 or residual.data_ptr() % 16 \
            or _row_stride(residual) % 8 or post_w.dtype != torch.float16:
        return None
    ws = o.workspace
    wsb, counters = ws.buffers()
    handles = [op.launch.handle for op in (o, gate_up, down)] + ([] if nxt is None else [nxt.launch.handle])
    return torch.ops.exl2_backend.exl2_gemv_chain(x, residual, post_w, next_w, o.launch.parts[0].packed, handles,
                                                  float(eps), wsb, counters, ws.chain_barrier)
