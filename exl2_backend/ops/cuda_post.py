"""RMSNorm applied at the GEMV's output (csrc/quant/exl2_gemv_post.cuh, csrc/quant/exl2_row_feed.cu).

The linear after a norm commutes with the norm's per-row scale: W (r * inv * w) = inv * (W (r * w)). So between
o and gate/up, and between down and the next layer's q/k/v, the producing GEMV's split-K finish writes the residual
stream r and each row's sums of squares per 256-column tile (`ss` [M, ceil(H / 256)] fp32; `feed`), and the
consumer gathers round(r * w') and scales each output row by rsqrt(sum / H + eps) at its finish (`post_normed`):
no norm launch and no norm prologue at any number of rows. Where the producer cannot feed (another kernel, a
pre-gathered input, the first layer's embedding rows) `exl2_row_feed` writes the same r and ss from its output.

Bit-identity: a row's r, sums, scale and products never depend on the rows beside it, so every M the consumer
takes (the GEMV's 1..32) gives each row the same bits: a speculative verify step's rows equal the decode step's.
The numerics are not add_rms_norm's (round(r * w') instead of round(r * inv * w)), so routing must send every M of
a consumer the same way: `posts` depends only on whether the consumer's GEMV takes M, never on the producer.
w' = w * 2^-e with 2^e >= max |w| keeps |r * w'| <= |r| (no fp16 overflow); the scale takes 2^e back exactly.

Ops: `exl2_backend::exl2_gemv_feed(x, residual, packed, handle, ws!, counters!, gate_off)` -> (r, ss),
`exl2_backend::exl2_row_feed(h, residual)` -> (r, ss), `exl2_backend::exl2_gemv_post_norm(r, ss, w_scaled, mul,
eps, packed, handle, ws!, counters!)` -> y, and its `_rope_kv` form. EXL2_BACKEND_POST_NORM=1 turns routing on
(off by default until measured on the GPU).
"""

from __future__ import annotations

import math
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
    CudaLinearOp,
    _check_norm_input,
    _check_x,
    _rope_args,
    _row_stride,
    _rows_aligned,
    _stream,
    gemv_row_cap,
)

POST_NORM = os.environ.get("EXL2_BACKEND_POST_NORM", "0") == "1"

_fns: dict[str, object] = {}


def _fn(name: str):
    if name not in _fns:
        P, I32, F32 = library.PTR, library.I32, library.F32
        sig = {
            "exl2_gemv_feed": (P, I32, P, I32, I32, I32, P, I32, P, I32, P, I32, P, I32, P, I32, P, P, I32,
                               library.STREAM),
            "exl2_gemv_post_norm": (P, I32, P, I32, I32, P, I32, P, F32, F32, P, I32, library.STREAM),
            "exl2_row_feed": (P, I32, I32, P, I32, P, I32, P, I32, I32, library.STREAM),
        }[name]
        _fns[name] = library.declare(name, *sig)
    return _fns[name]


def _built() -> bool:
    """The loaded library has the post norm (an older build, e.g. a baseline compared in one process, has not)."""
    return library.available() and hasattr(library.get(), "exl2_gemv_post_norm")


def tiles(hidden: int) -> int:
    """Tile sums per row of a hidden size: one per 256-column block of the producing GEMV."""
    return -(-hidden // _GEMV_COLS)


def scaled_norm_weight(weight: torch.Tensor) -> tuple[torch.Tensor, float]:
    """(w' = weight * 2^-e fp16, 2^e) with 2^e the least power of two >= max |weight| (at least 1): |r * w'| <=
    |r| keeps the consumer's fp16 products finite. Exact (a power-of-two scale) unless w' falls below fp16's normal
    range. Reads the weight back: call it outside graph capture (at load time)."""
    peak = float(weight.detach().float().abs().max().item()) if weight.numel() else 0.0
    if not math.isfinite(peak):
        raise TensorShapeError("the norm weight holds a NaN or inf", tensor="weight")
    e = max(0, math.ceil(math.log2(peak))) if peak > 0 else 0
    mul = float(2.0**e)
    return (weight.to(torch.float16) / mul).contiguous(), mul


# --- routing -----------------------------------------------------------------------------------------------


def _gemv_ready(launch, m: int) -> bool:
    return _built() and GEMV_MINB == 0 and gemv_row_cap(launch.device) == 32 and launch.takes_gemv(m)


def posts(consumer, m: int) -> bool:
    """Whether routing runs `consumer` (a linear after an RMSNorm) with the norm at its output for M rows: POST_NORM,
    a CUDA linear whose GEMV takes M, in_features a multiple of 8 up to 8192. Independent of the producer (see the
    module docstring)."""
    if not (POST_NORM and isinstance(consumer, CudaLinearOp)):
        return False
    launch = consumer.launch
    return _gemv_ready(launch, m) and launch.K % 8 == 0 and launch.K <= 8192


def _launch_feeds(launch, m: int) -> bool:
    return (_gemv_ready(launch, m) and len(launch.parts) == 1 and launch.out_features % 8 == 0
            and not launch.pregathers(m))


def can_feed(producer, m: int) -> bool:
    """Whether `producer`'s GEMV of M rows can write the residual stream and its tile sums itself: the TMA kernel
    takes M, one part, N a multiple of 8, no pre-gathered input (else: the GEMV, then exl2_row_feed)."""
    return isinstance(producer, CudaLinearOp) and _launch_feeds(producer.launch, m)


class StoredRows:
    """A consumer's stored row order, for a producer that writes its pre-gathered input (exl2_gemv_feed's y):
    inv int32 [parts, K] (part q's stored row of natural column k), pad int32 [parts, pad_ld] (its padding rows,
    npad[q] of them; written zero), ld (the pre-gathered buffer's row stride: the longest Kpad)."""

    def __init__(self, launch):
        k, dev = launch.K, launch.parts[0].xmap.device
        self.parts, self.ld = len(launch.parts), launch.kpad
        invs, pads = [], []
        for part in launch.parts:
            xm = part.xmap.to(torch.int32) & 0xFFFF  # [Kpad], 0xFFFF = padding row
            rows = torch.arange(xm.numel(), dtype=torch.int32, device=dev)
            valid = xm != 0xFFFF
            inv = torch.full((k,), -1, dtype=torch.int32, device=dev)
            inv[xm[valid].long()] = rows[valid]
            if int((inv < 0).sum().item()) or int(valid.sum().item()) != k:
                raise TensorShapeError("a part's row map is not a permutation of its input", tensor="xmap")
            invs.append(inv)
            pads.append(rows[~valid])
        self.inv = torch.stack(invs).contiguous()
        self.npad = np.array([t.numel() for t in pads], dtype=np.int32)
        pad_ld = max(1, int(self.npad.max()))
        self.pad = torch.zeros(self.parts, pad_ld, dtype=torch.int32, device=dev)
        for q, t in enumerate(pads):
            self.pad[q, : t.numel()] = t


def stored_rows(consumer: CudaLinearOp) -> StoredRows:
    """The consumer's StoredRows, built once and kept on its launch (it reads the maps back: outside graph
    capture)."""
    launch = consumer.launch
    if getattr(launch, "stored_rows", None) is None:
        launch.stored_rows = StoredRows(launch)
    return launch.stored_rows


def _consumer_rows(consumer: int) -> StoredRows | None:
    """The StoredRows of the launch with handle `consumer` (0: none; None where stored_rows never built them)."""
    return getattr(_REG[consumer], "stored_rows", None) if consumer else None


# --- custom ops --------------------------------------------------------------------------------------------


@torch.library.custom_op("exl2_backend::exl2_gemv_feed", mutates_args=("ws", "counters"))
def _gemv_feed_op(x: torch.Tensor, residual: torch.Tensor, packed: torch.Tensor, handle: int, ws: torch.Tensor,
                  counters: torch.Tensor, gate_off: int, consumer: int,
                  w_scaled: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [M, K] (gate_off > 0: [M, 2K] gate | up, the input silu(gate) * up), residual [M, N] fp16 -> (r [M, N] =
    round(GEMV + residual), ss fp32 [M, ceil(N / 256)] the tile sums of squares of r, y): with consumer (a launch
    handle whose StoredRows exist; 0: none) and w_scaled [N], y = round(r * w_scaled) in the consumer's stored row
    order [parts, M, ld] (its pre-gathered input), else an empty tensor."""
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
    if not _launch_feeds(launch, m):
        raise TensorShapeError(f"the feeding GEMV does not take {m} rows of this linear", tensor="x")
    _check_norm_input(residual, "residual", n, m, dev)
    r, blob = launch._bind(launch.gemv_plan(m), m, ws, counters, dev)
    ss = torch.empty(m, tiles(n), dtype=torch.float32, device=dev)
    rows = _consumer_rows(consumer)
    if consumer and (rows is None or w_scaled is None or w_scaled.shape != (n,) or w_scaled.dtype != torch.float16
                     or w_scaled.device != dev or not w_scaled.is_contiguous() or rows.inv.shape[1] != n):
        raise TensorShapeError(f"the consumer's stored rows and a float16 [{n}] scaled weight are needed",
                               tensor="w_scaled")
    if rows is None:
        y = torch.empty(0, dtype=torch.float16, device=dev)
        scatter = (None, 0, None, 0, None, 0, None, None, 0)
    else:
        y = torch.empty(rows.parts, m, rows.ld, dtype=torch.float16, device=dev)
        scatter = (w_scaled.data_ptr(), rows.parts, rows.inv.data_ptr(), n, rows.pad.data_ptr(), rows.pad.shape[1],
                   rows.npad.ctypes.data, y.data_ptr(), rows.ld)
    st = _fn("exl2_gemv_feed")(blob.ctypes.data, 1, x.data_ptr(), m, _row_stride(x), gate_off,
                               residual.data_ptr(), _row_stride(residual), ss.data_ptr(), ss.shape[1], *scatter,
                               _stream(dev))
    library.check(st, "exl2_gemv_feed")
    return r, ss, y


@_gemv_feed_op.register_fake
def _(x, residual, packed, handle, ws, counters, gate_off, consumer, w_scaled):
    n, m = _REG[handle].out_features, x.shape[0]
    rows = _consumer_rows(consumer)
    y = x.new_empty((0,)) if rows is None else x.new_empty((rows.parts, m, rows.ld))
    return x.new_empty((m, n)), x.new_empty((m, tiles(n)), dtype=torch.float32), y


@torch.library.custom_op("exl2_backend::exl2_row_feed", mutates_args=())
def _row_feed_op(h: torch.Tensor, residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(r = round(h + residual) [M, N] (h itself, copied, without a residual), ss fp32 [M, ceil(N / 256)]): what
    exl2_gemv_feed writes, from a GEMV's output h."""
    if not (isinstance(h, torch.Tensor) and h.dim() == 2 and h.is_cuda):
        raise TensorShapeError("h must be a 2-D CUDA tensor", tensor="h")
    m, n = h.shape
    if n % 8:
        raise TensorShapeError(f"the hidden size {n} must be a multiple of 8", tensor="h")
    _check_norm_input(h, "h", n, m, h.device)
    if residual is not None:
        _check_norm_input(residual, "residual", n, m, h.device)
    r = torch.empty(m, n, dtype=torch.float16, device=h.device)
    ss = torch.empty(m, tiles(n), dtype=torch.float32, device=h.device)
    stream = _stream(h.device)
    if residual is None:
        r.copy_(h)
    st = _fn("exl2_row_feed")(h.data_ptr(), m, _row_stride(h), None if residual is None else residual.data_ptr(),
                              0 if residual is None else _row_stride(residual),
                              None if residual is None else r.data_ptr(), n, ss.data_ptr(), ss.shape[1], n, stream)
    library.check(st, "exl2_row_feed")
    return r, ss


@_row_feed_op.register_fake
def _(h, residual):
    return h.new_empty(h.shape), h.new_empty((h.shape[0], tiles(h.shape[1])), dtype=torch.float32)


def _check_post_call(launch, r: torch.Tensor, ss: torch.Tensor, w_scaled: torch.Tensor, mul: float,
                     packed: torch.Tensor) -> int:
    """Checks the post norm's inputs (TensorShapeError); returns M."""
    k, dev = launch.K, packed.device
    m = r.shape[0] if isinstance(r, torch.Tensor) and r.dim() == 2 else -1
    _check_norm_input(r, "r", k, m, dev)
    if not (isinstance(ss, torch.Tensor) and ss.dtype == torch.float32 and ss.device == dev and ss.dim() == 2
            and ss.shape == (m, tiles(k)) and ss.stride(1) == 1):
        raise TensorShapeError(f"ss must be a float32 [{m}, {tiles(k)}] tensor on {dev} with contiguous rows",
                               tensor="ss")
    if not (isinstance(w_scaled, torch.Tensor) and w_scaled.shape == (k,) and w_scaled.dtype == torch.float16
            and w_scaled.device == dev and w_scaled.is_contiguous()):
        raise TensorShapeError(f"w_scaled must be a contiguous float16 [{k}] tensor on {dev}", tensor="w_scaled")
    if not (mul > 0 and math.isfinite(mul)):
        raise TensorShapeError(f"mul must be a positive power of two, not {mul}", tensor="mul")
    if not _gemv_ready(launch, m):
        raise TensorShapeError(f"the post-norm GEMV does not take {m} rows of this linear", tensor="r")
    return m


def _check_y(launch, y: torch.Tensor | None, m: int, dev) -> None:
    if y is None:
        return
    want = (len(launch.parts), m, launch.kpad)
    if not (isinstance(y, torch.Tensor) and y.dtype == torch.float16 and y.device == dev and tuple(y.shape) == want
            and y.is_contiguous()):
        raise TensorShapeError(f"y must be a contiguous float16 {list(want)} tensor on {dev} (exl2_gemv_feed's)",
                               tensor="y")


def _post_norm(launch, r, ss, w_scaled, mul, eps, ws, counters, rope: np.ndarray | None,
               y: torch.Tensor | None) -> torch.Tensor:
    m = r.shape[0]
    out, blob = launch._bind(launch.gemv_plan(m), m, ws, counters, r.device)
    if rope is not None:
        blob[0, F_ROPE] = rope.ctypes.data  # read by the C call below, while `rope` is alive
    st = _fn("exl2_gemv_post_norm")(blob.ctypes.data, len(launch.parts), r.data_ptr(), m, _row_stride(r),
                                    ss.data_ptr(), _row_stride(ss), w_scaled.data_ptr(), float(mul), float(eps),
                                    None if y is None else y.data_ptr(), 0 if y is None else launch.kpad,
                                    _stream(r.device))
    library.check(st, "exl2_gemv_post_norm")
    return out


@torch.library.custom_op("exl2_backend::exl2_gemv_post_norm", mutates_args=("ws", "counters"))
def _gemv_post_norm_op(r: torch.Tensor, ss: torch.Tensor, w_scaled: torch.Tensor, mul: float, eps: float,
                       packed: torch.Tensor, handle: int, ws: torch.Tensor, counters: torch.Tensor,
                       y: torch.Tensor | None) -> torch.Tensor:
    """GEMV of rms_norm(r) * (w_scaled * mul), the norm's scale from the tile sums ss applied at the output; y (None:
    gathered from r): round(r * w_scaled) already in stored row order (exl2_gemv_feed's)."""
    launch = _REG[handle]
    m = _check_post_call(launch, r, ss, w_scaled, mul, packed)
    _check_y(launch, y, m, packed.device)
    return _post_norm(launch, r, ss, w_scaled, mul, eps, ws, counters, None, y)


@_gemv_post_norm_op.register_fake
def _(r, ss, w_scaled, mul, eps, packed, handle, ws, counters, y):
    return r.new_empty((r.shape[0], _REG[handle].out_features))


@torch.library.custom_op("exl2_backend::exl2_gemv_post_norm_rope_kv",
                         mutates_args=("ws", "counters", "k_cache", "v_cache"))
def _gemv_post_norm_rope_kv_op(r: torch.Tensor, ss: torch.Tensor, w_scaled: torch.Tensor, mul: float, eps: float,
                               packed: torch.Tensor, handle: int, ws: torch.Tensor, counters: torch.Tensor,
                               positions: torch.Tensor, inv_freq: torch.Tensor, k_cache: torch.Tensor,
                               v_cache: torch.Tensor, slots: torch.Tensor, y: torch.Tensor | None) -> torch.Tensor:
    """exl2_gemv_post_norm of the q/k/v projection with rope_kv_write fused after it (as exl2_gemv_add_norm_rope_kv)."""
    launch = _REG[handle]
    m = _check_post_call(launch, r, ss, w_scaled, mul, packed)
    _check_y(launch, y, m, packed.device)
    rope = _rope_args(launch, m, positions, inv_freq, k_cache, v_cache, slots)
    return _post_norm(launch, r, ss, w_scaled, mul, eps, ws, counters, rope, y)


@_gemv_post_norm_rope_kv_op.register_fake
def _(r, ss, w_scaled, mul, eps, packed, handle, ws, counters, positions, inv_freq, k_cache, v_cache, slots, y):
    return r.new_empty((r.shape[0], _REG[handle].out_features))


# --- model-facing entries ----------------------------------------------------------------------------------


def feed(op: CudaLinearOp, x: torch.Tensor, residual: torch.Tensor, gated: bool = False,
         consumer: CudaLinearOp | None = None, scaled: tuple[torch.Tensor, float] | None = None):
    """(r = op(x) + residual [M, N], ss [M, tiles(N)], y) in one GEMV; gated: x is gate | up [M, 2K] and the input
    silu(gate) * up (op.gated's layout); with consumer and scaled (scaled_norm_weight of its norm), y = its input
    round(r * w') pre-gathered in its stored row order (post_normed's y), else None. None where the GEMV cannot run
    (the caller runs op, then row_feed)."""
    m = x.shape[0] if x.dim() == 2 else 0
    k = op.in_features
    if not (m and can_feed(op, m) and x.dtype == torch.float16 and x.stride(-1) == 1 and _rows_aligned(residual)
            and residual.shape == (m, op.out_features) and x.shape[1] == (2 * k if gated else k)):
        return None
    if gated and x.stride(0) != 2 * k:
        return None
    launch = op.launch
    handle, w_scaled = 0, None
    if consumer is not None and scaled is not None and consumer.launch.K == op.out_features:
        stored_rows(consumer)
        handle, w_scaled = consumer.launch.handle, scaled[0]
    ws, counters = op.workspace.buffers()
    r, ss, y = torch.ops.exl2_backend.exl2_gemv_feed(x, residual, launch.parts[0].packed, launch.handle, ws, counters,
                                                     k if gated else 0, handle, w_scaled)
    return r, ss, (y if handle else None)


def row_feed(h: torch.Tensor, residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, None]:
    """(r = h + residual, ss, None) from a GEMV's output: feed's r and ss, bit for bit (no pre-gathered y)."""
    r, ss = torch.ops.exl2_backend.exl2_row_feed(h, residual)
    return r, ss, None


def post_normed(op: CudaLinearOp, r: torch.Tensor, ss: torch.Tensor, scaled: tuple[torch.Tensor, float], eps: float,
                rope: tuple | None = None, y: torch.Tensor | None = None) -> torch.Tensor | None:
    """op(rms_norm(r) * w) from the residual stream r and its tile sums ss; scaled = scaled_norm_weight(w); rope:
    (positions, inv_freq, k_cache, v_cache, slots) for a q/k/v projection that also rotates and writes the cache
    (as CudaLinearOp.add_normed_rope_kv); y: feed's pre-gathered input for op (None: the GEMV gathers it from r,
    the same bits). None where the rope's tensors do not fit (the caller then calls it without rope and rotates
    itself)."""
    w_scaled, mul = scaled
    launch = op.launch
    ws, counters = op.workspace.buffers()
    packed = launch.parts[0].packed
    if rope is None:
        return torch.ops.exl2_backend.exl2_gemv_post_norm(r, ss, w_scaled, float(mul), float(eps), packed,
                                                          launch.handle, ws, counters, y)
    try:
        _rope_args(launch, r.shape[0], *rope)
    except TensorShapeError:
        return None
    return torch.ops.exl2_backend.exl2_gemv_post_norm_rope_kv(r, ss, w_scaled, float(mul), float(eps), packed,
                                                              launch.handle, ws, counters, *rope, y)
