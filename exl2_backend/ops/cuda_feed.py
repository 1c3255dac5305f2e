"""The norm fed by the GEMV before it (csrc/quant/exl2_gemv_norm.cuh gv_feed_finish, gv_fed_rows).

Between two GEMVs of a decoder layer (o -> gate/up, down -> the next layer's q/k/v) sits an RMSNorm over the
residual stream. A verify step of more rows than the fused norm takes in one pass ran it as its own launch (the
pre-gathering norm), 64 launches of ~3.9 us on the 8B's critical path (H100, session 52). Here the producing GEMV's
split-K finish, which holds each 256-column block of its output, adds the residual, writes the residual stream r
and the block's sum of squares per row (`ss` [M, ceil(H / 256)] fp32); the consumer's blocks copy the rows of r,
sum the M x tiles partials in tile order and normalize only their own rows. Every norm kernel sums in that tile order
(csrc/quant/exl2_gemv_norm.cuh), so the fed GEMV is bit-identical to add_rms_norm followed by the GEMV.

Ops: `exl2_backend::exl2_gemv_feed(x, residual, packed, handle, ws!, counters!, gate_off)` -> (r, ss) and
`exl2_backend::exl2_gemv_fed_norm(r, ss, weight, eps, packed, handle, ws!, counters!, rope)` -> y; the model-facing
entries are `feeds_norm`, `feed` and `fed_normed` (None where they do not run: the caller runs the ops one by one).
EXL2_BACKEND_NORM_FEED=0 turns routing off (same bits), for A/B timing.
"""

from __future__ import annotations

import os

import numpy as np
import torch

from exl2_backend.errors import TensorShapeError
from exl2_backend.ops import library
from exl2_backend.ops.cuda_quant import (
    _GEMV_COLS,
    _REG,
    F_ROPE,
    GEMV_MINB,
    NORM_SMEM_BYTES,
    CudaLinearOp,
    _check_norm_input,
    _check_x,
    _rope_args,
    _row_stride,
    _rows_aligned,
    _stream,
    gemv_row_cap,
)

NORM_FEED = os.environ.get("EXL2_BACKEND_NORM_FEED", "1") != "0"

_fns: dict[str, object] = {}


def _fn(name: str):
    if name not in _fns:
        P, I32 = library.PTR, library.I32
        sig = {
            "exl2_gemv_feed": (P, I32, P, I32, I32, I32, P, I32, P, I32, library.STREAM),
            "exl2_gemv_fed_norm": (P, I32, P, I32, I32, P, I32, P, library.F32, library.STREAM),
        }[name]
        _fns[name] = library.declare(name, *sig)
    return _fns[name]


def _built() -> bool:
    """The loaded library has the feed (an older build, e.g. a baseline compared in one process, has not)."""
    return library.available() and hasattr(library.get(), "exl2_gemv_feed")


def tiles(hidden: int) -> int:
    """Tile sums per row of a hidden size: one per 256-column block of the producing GEMV."""
    return -(-hidden // _GEMV_COLS)


def can_feed(launch, m: int, pregathers: bool) -> bool:
    """Whether a launch of M rows can run as a feeding GEMV: the TMA kernel takes M, one part, N a multiple of 8 and
    no pre-gathered input (the feed launches the GEMV alone)."""
    return (_built() and GEMV_MINB == 0 and gemv_row_cap(launch.device) == 32 and launch.takes_gemv(m)
            and len(launch.parts) == 1 and launch.out_features % 8 == 0 and not pregathers)


def can_fed_norm(launch, m: int) -> bool:
    """Whether a launch of M rows can normalize a fed input: the TMA kernel takes M, K a multiple of 8 up to 8192,
    and the M raw rows fit NORM_SMEM_BYTES (the norm-fused GEMV's bound; the weight's K halves come on top)."""
    return (_built() and GEMV_MINB == 0 and gemv_row_cap(launch.device) == 32 and launch.takes_gemv(m)
            and launch.K % 8 == 0 and launch.K <= 8192 and m * launch.K * 2 <= NORM_SMEM_BYTES)


def feeds_norm(producer, consumer, m: int, gated: bool = False) -> bool:
    """Whether routing runs producer -> consumer's norm as a feed for M rows (NORM_FEED, both CUDA linears of one
    device, the producer's output the consumer's input)."""
    if not (NORM_FEED and isinstance(producer, CudaLinearOp) and isinstance(consumer, CudaLinearOp)):
        return False
    if producer.device != consumer.device or producer.out_features != consumer.in_features:
        return False
    pl = producer.launch
    pregathers = pl.pregathers(m) if m >= 1 else False
    return can_feed(pl, m, pregathers) and can_fed_norm(consumer.launch, m)


# --- custom ops --------------------------------------------------------------------------------------------


@torch.library.custom_op("exl2_backend::exl2_gemv_feed", mutates_args=("ws", "counters"))
def _gemv_feed_op(x: torch.Tensor, residual: torch.Tensor, packed: torch.Tensor, handle: int, ws: torch.Tensor,
                  counters: torch.Tensor, gate_off: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] (gate_off > 0: [M, 2K] gate | up, the input silu(gate) * up), residual [M, N] fp16 -> (r [M, N] =
    GEMV + residual, ss fp32 [M, ceil(N / 256)] the tile sums of squares of r)."""
    launch = _REG[handle]
    dev = packed.device
    k, n = launch.K, launch.out_features
    if gate_off:
        if x.dim() != 2 or x.shape[1] != 2 * k or x.stride(1) != 1 or x.dtype != torch.float16 or x.device != dev:
            raise TensorShapeError(f"gate_up must be float16 [M, {2 * k}] with contiguous rows on {dev}",
                                   tensor="gate_up")
    else:
        _check_x(x, k, dev)
    m = x.shape[0]
    if not can_feed(launch, m, False):
        raise TensorShapeError(f"the feeding GEMV does not take {m} rows of this linear", tensor="x")
    _check_norm_input(residual, "residual", n, m, dev)
    pl = launch.gemv_plan(m)
    r, blob = launch._bind(pl, m, ws, counters, dev)
    ss = torch.empty(m, tiles(n), dtype=torch.float32, device=dev)
    st = _fn("exl2_gemv_feed")(blob.ctypes.data, 1, x.data_ptr(), m, _row_stride(x), gate_off,
                               residual.data_ptr(), _row_stride(residual), ss.data_ptr(), ss.shape[1], _stream(dev))
    library.check(st, "exl2_gemv_feed")
    return r, ss


@_gemv_feed_op.register_fake
def _(x, residual, packed, handle, ws, counters, gate_off):
    n = _REG[handle].out_features
    return x.new_empty((x.shape[0], n)), x.new_empty((x.shape[0], tiles(n)), dtype=torch.float32)


def _check_fed_call(launch, r: torch.Tensor, ss: torch.Tensor, weight: torch.Tensor, packed: torch.Tensor) -> int:
    """Checks the fed norm's inputs (TensorShapeError); returns M."""
    k, dev = launch.K, packed.device
    m = r.shape[0] if isinstance(r, torch.Tensor) and r.dim() == 2 else -1
    _check_norm_input(r, "r", k, m, dev)
    if not (isinstance(ss, torch.Tensor) and ss.dtype == torch.float32 and ss.device == dev and ss.dim() == 2
            and ss.shape == (m, tiles(k)) and ss.stride(1) == 1):
        raise TensorShapeError(f"ss must be a float32 [{m}, {tiles(k)}] tensor on {dev} with contiguous rows",
                               tensor="ss")
    if not (isinstance(weight, torch.Tensor) and weight.shape == (k,) and weight.dtype == torch.float16
            and weight.device == dev and weight.is_contiguous() and weight.data_ptr() % 16 == 0):
        raise TensorShapeError(f"weight must be a contiguous 16-byte aligned float16 [{k}] tensor on {dev}",
                               tensor="weight")
    if not can_fed_norm(launch, m):
        raise TensorShapeError(f"the fed norm does not take {m} rows of this linear", tensor="r")
    return m


def _fed_norm(launch, r, ss, weight, eps, ws, counters, rope: np.ndarray | None) -> torch.Tensor:
    m = r.shape[0]
    out, blob = launch._bind(launch.gemv_plan(m), m, ws, counters, r.device)
    if rope is not None:
        blob[0, F_ROPE] = rope.ctypes.data  # read by the C call below, while `rope` is alive
    st = _fn("exl2_gemv_fed_norm")(blob.ctypes.data, len(launch.parts), r.data_ptr(), m, _row_stride(r),
                                   ss.data_ptr(), _row_stride(ss), weight.data_ptr(), float(eps), _stream(r.device))
    library.check(st, "exl2_gemv_fed_norm")
    return out


@torch.library.custom_op("exl2_backend::exl2_gemv_fed_norm", mutates_args=("ws", "counters"))
def _gemv_fed_norm_op(r: torch.Tensor, ss: torch.Tensor, weight: torch.Tensor, eps: float, packed: torch.Tensor,
                      handle: int, ws: torch.Tensor, counters: torch.Tensor) -> torch.Tensor:
    """GEMV of rms_norm(r) * weight, the norm's sum from the tile sums ss (exl2_gemv_feed's outputs)."""
    launch = _REG[handle]
    _check_fed_call(launch, r, ss, weight, packed)
    return _fed_norm(launch, r, ss, weight, eps, ws, counters, None)


@_gemv_fed_norm_op.register_fake
def _(r, ss, weight, eps, packed, handle, ws, counters):
    return r.new_empty((r.shape[0], _REG[handle].out_features))


@torch.library.custom_op("exl2_backend::exl2_gemv_fed_norm_rope_kv",
                         mutates_args=("ws", "counters", "k_cache", "v_cache"))
def _gemv_fed_norm_rope_kv_op(r: torch.Tensor, ss: torch.Tensor, weight: torch.Tensor, eps: float,
                              packed: torch.Tensor, handle: int, ws: torch.Tensor, counters: torch.Tensor,
                              positions: torch.Tensor, inv_freq: torch.Tensor, k_cache: torch.Tensor,
                              v_cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """exl2_gemv_fed_norm of the q/k/v projection with rope_kv_write fused after it (as exl2_gemv_add_norm_rope_kv)."""
    launch = _REG[handle]
    m = _check_fed_call(launch, r, ss, weight, packed)
    rope = _rope_args(launch, m, positions, inv_freq, k_cache, v_cache, slots)
    return _fed_norm(launch, r, ss, weight, eps, ws, counters, rope)


@_gemv_fed_norm_rope_kv_op.register_fake
def _(r, ss, weight, eps, packed, handle, ws, counters, positions, inv_freq, k_cache, v_cache, slots):
    return r.new_empty((r.shape[0], _REG[handle].out_features))


# --- model-facing entries ----------------------------------------------------------------------------------


def feed(op: CudaLinearOp, x: torch.Tensor, residual: torch.Tensor,
         gated: bool = False) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(r = op(x) + residual [M, N], ss [M, tiles(N)]) in one GEMV; gated: x is gate | up [M, 2K] and the input
    silu(gate) * up (op.gated's layout). None where the inputs are not laid out for it."""
    m = x.shape[0] if x.dim() == 2 else 0
    k = op.in_features
    if not (m and x.dtype == torch.float16 and x.stride(-1) == 1 and _rows_aligned(residual)
            and residual.shape == (m, op.out_features)):
        return None
    if gated and not (x.shape[1] == 2 * k and x.stride(0) == 2 * k):
        return None
    launch = op.launch
    ws, counters = op.workspace.buffers()
    return torch.ops.exl2_backend.exl2_gemv_feed(x, residual, launch.parts[0].packed, launch.handle, ws, counters,
                                                 k if gated else 0)


def fed_normed(op: CudaLinearOp, r: torch.Tensor, ss: torch.Tensor, weight: torch.Tensor, eps: float,
               rope: tuple | None = None) -> torch.Tensor | None:
    """op(rms_norm(r) * weight) from feed's outputs; rope: (positions, inv_freq, k_cache, v_cache, slots) for a
    q/k/v projection that also rotates and writes the cache (as CudaLinearOp.add_normed_rope_kv). None where the
    weight or the rope's tensors do not fit (the caller then normalizes r itself)."""
    if not (weight.dtype == torch.float16 and weight.is_contiguous() and weight.data_ptr() % 16 == 0):
        return None
    launch = op.launch
    ws, counters = op.workspace.buffers()
    packed = launch.parts[0].packed
    if rope is None:
        return torch.ops.exl2_backend.exl2_gemv_fed_norm(r, ss, weight, float(eps), packed, launch.handle, ws,
                                                         counters)
    try:
        _rope_args(launch, r.shape[0], *rope)
    except TensorShapeError:
        return None
    return torch.ops.exl2_backend.exl2_gemv_fed_norm_rope_kv(r, ss, weight, float(eps), packed, launch.handle, ws,
                                                             counters, *rope)
