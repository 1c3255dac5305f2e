"""A decoder layer's GEMV chain in one persistent launch (csrc/quant/exl2_gemv_chain.cu).

After attention a decode step runs four dependent GEMVs per layer: O, gate/up (with the post-attention norm), down
(silu_mul in its gather) and the next layer's q/k/v (with its input norm). Each was its own launch, and each launch
paid a ramp and a tail (~6 us per GEMV on the H200 against 7-16 us of streaming). `exl2_gemv_chain` runs them as
phases of one grid with a grid barrier between them; the next phase's weights stream while the previous phase
finishes. Every phase is the GEMV it replaces, planned the same way, so the outputs are bit-identical.

Op: `exl2_backend::exl2_gemv_chain(x, residual, post_w, next_w, packed, handles, eps, ws!, counters!, barrier!)`
-> (out, residual_out); see `_chain_op`. `mlp_chain` is the model-facing entry: None where the chain does not run
(then the caller runs the ops one by one). Where a norm cannot be fused into its GEMV in one pass (K = 4096 from M = 3:
verify steps, batches of sequences), a norm phase replaces the add_rms_norm launch, and pregather phases replace
the pregather launches.
"""

from __future__ import annotations

import os

import numpy as np
import torch

from exl2_backend.errors import TensorShapeError
from exl2_backend.ops import library
from exl2_backend.ops.cuda_quant import _REG, CudaLinearOp, _check_norm_input, _check_x, _row_stride, gemv_row_cap

# Opt-in (EXL2_BACKEND_GEMV_CHAIN=1) until it is faster: H200 call M1 of 2026-12-02, the 8B decode step took 4.44 ms
# with the chain against 2.88 ms with the GEMVs one by one (eager: 122 us per chain kernel against 85 us for its
# four GEMVs), same tokens and bit-identical logits. scripts/chain_bench.py isolates it.
GEMV_CHAIN = os.environ.get("EXL2_BACKEND_GEMV_CHAIN", "0") == "1"
# Its work items stay inside one width run (per-run splits; exl2_gemv_chain.cu plans with allow_span=false), so with
# the default span splits of the one-launch GEMV its sums differ from the launches' in the last bits.
CHAIN_FIELDS = 13  # int64 per phase; csrc/quant/exl2_gemv.cuh kChainFields
GEMV, PREGATHER, NORM = 0, 1, 2  # phase kinds
MAX_M = 8  # one token tile: the chain kernel instantiates the M <= 8 path only
# > 0 caps the chain's grid (tests: each block then loops over several work items of a phase); 0 = every resident
# block (the occupancy times the SMs, at most the largest phase's work items).
MAX_GRID = 0
# Norm phases instead of the norm fused into the next GEMV: "never" (the chain runs only where each norm fuses in
# one pass: K = 4096 -> M <= 2), "auto" where the fused norm would take more than one pass (_Launch.takes_norm),
# "always" (tests: the norm phases on every shape). "never" by default: H200 call M3 of 2026-12-02 found the 8B
# layer at M = 5 with norm phases off by ~0.5% against the launches one by one (M = 8, SmolLM2's shape with forced
# norm phases, and scripts/chain_bench.py's 8B layer at M = 5 were bit-identical): not yet explained.
NORM_PHASES = os.environ.get("EXL2_BACKEND_CHAIN_NORM_PHASES", "never")
if NORM_PHASES not in ("never", "auto", "always"):
    raise ValueError(f"EXL2_BACKEND_CHAIN_NORM_PHASES must be never, auto or always, got {NORM_PHASES!r}")

_fn = None


def _chain_fn():
    global _fn
    if _fn is None:
        P, I32 = library.PTR, library.I32
        _fn = library.declare("exl2_gemv_chain", P, I32, I32, library.F32, I32, P, library.STREAM)
    return _fn


def _fuses_norm(launch, m: int) -> bool:
    """The norm inside the GEMV (one pass of its rows) rather than a norm phase before it."""
    return NORM_PHASES != "always" and launch.takes_norm(m)


def chain_takes(o, gate_up, down, nxt, m: int) -> bool:
    """Whether the chain runs M rows through o -> gate_up (normed) -> down (gated) [-> nxt (normed)]: CUDA linears
    on one sm_90+ device that route M rows to the GEMV, with matching shapes. Each norm is fused into its GEMV
    where that takes one pass, else it is a norm phase; an input the one-by-one path would pre-gather is
    pre-gathered by a phase of the chain."""
    ops_ = (o, gate_up, down) + (() if nxt is None else (nxt,))
    if not (GEMV_CHAIN and 1 <= m <= MAX_M and all(isinstance(op, CudaLinearOp) for op in ops_)):
        return False
    if len({op.device for op in ops_}) != 1 or gemv_row_cap(o.device) != 32:
        return False
    hidden = o.out_features
    if gate_up.in_features != hidden or gate_up.out_features != 2 * down.in_features or down.out_features != hidden:
        return False
    if nxt is not None and nxt.in_features != hidden:
        return False
    normed = (gate_up,) + (() if nxt is None else (nxt,))
    if NORM_PHASES == "never" and not all(op.launch.takes_norm(m) for op in normed):
        return False
    return all(op.launch.takes_gemv(m) for op in ops_) and all(_normable(op.launch) for op in normed) \
        and len(down.launch.parts) == 1


def _normable(launch) -> bool:
    """A norm over the launch's K rows runs, fused or as a phase: K a multiple of 8, at most 8192."""
    return launch.K % 8 == 0 and launch.K <= 8192


def _row(kind: int, launch, blob: np.ndarray, x: torch.Tensor, ldx: int, gate_off: int = 0, norm=None,
         xpre: torch.Tensor | None = None) -> list[int]:
    """One phase of the table: the kind, the descriptors (bound for a GEMV; their xmap and Kpad for the others),
    the input, the norm (weight, residual, residual out) or none, the stored-order input or output."""
    w, res, res_out = norm if norm is not None else (None, None, None)
    return [kind, blob.ctypes.data, len(launch.parts), x.data_ptr(), ldx, gate_off,
            0 if w is None else w.data_ptr(), 0 if res is None else res.data_ptr(),
            0 if res is None else _row_stride(res), 0 if res_out is None else res_out.data_ptr(),
            0 if res_out is None else res_out.shape[1], 0 if xpre is None else xpre.data_ptr(),
            0 if xpre is None else launch.kpad]


class _Table:
    """The chain's phases as they are planned, and the buffers they write (alive until the launch)."""

    def __init__(self, m: int, ws: torch.Tensor, counters: torch.Tensor, like: torch.Tensor):
        self.m, self.ws, self.counters, self.like = m, ws, counters, like
        self.rows: list[list[int]] = []
        self.keep: list[object] = []

    def _stored(self, launch) -> torch.Tensor:  # [parts, M, Kpad]: the input in each part's stored row order
        return self.like.new_empty((len(launch.parts) * self.m * launch.kpad,))

    def gemv(self, launch, x: torch.Tensor, ldx: int, gate_off: int = 0, norm=None) -> torch.Tensor:
        """The GEMV of x (gated / normed as exl2_gemv / exl2_gemv_add_norm), pre-gathered by a phase before it
        where the one-by-one path pre-gathers; returns its output [M, N]."""
        out, blob = launch._bind(launch.gemv_plan(self.m), self.m, self.ws, self.counters, x.device)
        xpre = None
        if norm is None and launch.pregathers(self.m, x, gate_off):
            xpre = self._stored(launch)
            self.rows.append(_row(PREGATHER, launch, blob, x, ldx, gate_off, xpre=xpre))
        self.rows.append(_row(GEMV, launch, blob, x, ldx, gate_off, norm=norm, xpre=xpre))
        self.keep += [blob, xpre]
        return out

    def normed_gemv(self, launch, h: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, fused: bool):
        """(GEMV of rms_norm(h + residual) * weight, h + residual): the norm fused into the GEMV, or a norm phase
        writing the GEMV's stored-order input and the residual stream."""
        res_out = h.new_empty(h.shape)
        if fused:
            return self.gemv(launch, h, _row_stride(h), norm=(weight, residual, res_out)), res_out
        out, blob = launch._bind(launch.gemv_plan(self.m), self.m, self.ws, self.counters, h.device)
        xpre = self._stored(launch)
        self.rows.append(_row(NORM, launch, blob, h, _row_stride(h), norm=(weight, residual, res_out), xpre=xpre))
        self.rows.append(_row(GEMV, launch, blob, h, _row_stride(h), xpre=xpre))
        self.keep += [blob, xpre]
        return out, res_out


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
    for launch in launches:
        if not (launch.takes_gemv(m) and (launch not in (gu, nx) or _normable(launch))):
            raise TensorShapeError(f"the GEMV chain does not take {m} rows of these linears", tensor="x")
    t = _Table(m, ws, counters, x)
    o_out = t.gemv(o, x, _row_stride(x))
    gu_out, r1 = t.normed_gemv(gu, o_out, residual, post_w, _fuses_norm(gu, m))
    out, res_out = t.gemv(dn, gu_out, gu.out_features, gate_off=dn.K), r1
    if nx is not None:
        out, res_out = t.normed_gemv(nx, out, r1, next_w, _fuses_norm(nx, m))
    table = np.asarray(t.rows, dtype=np.int64)
    st = _chain_fn()(table.ctypes.data, len(t.rows), m, float(eps), MAX_GRID, barrier.data_ptr(),
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
