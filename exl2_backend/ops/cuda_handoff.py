"""The norm handoff between two small-M GEMVs (csrc/quant/exl2_gemv_handoff.cuh).

A decoder layer normalizes twice: rms_norm(o_proj(attn) + residual) before gate/up and rms_norm(down(..) +
residual) before the next layer's q/k/v. The norm fused into the next GEMV has each of its ~264 blocks read all M
rows of h and of the residual, which past two rows (a k = 4 verify step: M = 5) costs more than a norm launch of
its own (`_Launch.takes_norm`), so verify steps ran 64 extra launches. The handoff splits the norm over the two
GEMVs instead:

- `residual_handoff(op, x, residual)`: the producing GEMV (o_proj, or down with its silu_mul input) also writes
  r = y + residual (the next residual stream, bit-identical to add_rms_norm's) and, per token, the sum of r^2 over
  each of its 256-column blocks: sq fp32 [M, ceil(H / 256)].
- `normed_handoff(op, r, sq, weight, eps)`: the consuming GEMV sums a token's partials, then gathers only its own
  rows of r, normalized on the way (with the q/k/v projection's rope and KV-cache write where asked).

The sum of squares runs in another order than add_rms_norm's, so a normalized input may differ from it by one
fp16 ulp; everything else is the same arithmetic. Both return None where the kernel does not take the launch (the
caller runs the usual ops).
"""

from __future__ import annotations

import numpy as np
import torch

from exl2_backend.errors import TensorShapeError
from exl2_backend.ops.cuda_quant import (
    _GEMV_COLS,
    _REG,
    F_HANDOFF,
    F_ROPE,
    GEMV_MINB,
    CudaLinearOp,
    _Launch,
    _rope_args,
    _row_stride,
    _rows_aligned,
    gemv_row_cap,
)

_OUT, _IN = 1, 2  # exl2_gemv_handoff.cuh kHandOut / kHandIn


def column_blocks(width: int) -> int:
    """Partial sums per token of a stream `width` wide: one per 256-column block of the producing GEMV."""
    return -(-width // _GEMV_COLS)


def can_handoff(launch: _Launch, m: int, out: bool) -> bool:
    """Whether the TMA GEMV takes M rows of `launch` with a handoff: out, one part whose width is whole groups of
    4 up to 8192 (the stream); in, a hidden size that is a multiple of 8 up to 8192."""
    if not (GEMV_MINB == 0 and gemv_row_cap(launch.device) == 32 and launch.takes_gemv(m)):
        return False
    if out:
        return len(launch.parts) == 1 and launch.out_features % 4 == 0 and launch.out_features <= 8192
    return launch.K % 8 == 0 and launch.K <= 8192


def _check(t: torch.Tensor, name: str, shape: tuple, dtype: torch.dtype, device: torch.device) -> None:
    """TensorShapeError unless t is a `dtype` tensor of `shape` on `device` with contiguous rows, fp16 rows starting
    16-byte aligned (fp32 sums of squares: 4-byte)."""
    if not (isinstance(t, torch.Tensor) and t.dtype == dtype and t.device == device and t.dim() == 2
            and tuple(t.shape) == shape and t.stride(1) == 1 and (dtype != torch.float16 or _rows_aligned(t))):
        raise TensorShapeError(f"{name} must be a {dtype} {list(shape)} tensor on {device} with contiguous rows "
                               "(fp16 rows starting 16-byte aligned)", tensor=name)


def _gemv(launch: _Launch, x: torch.Tensor, gate_off: int, ws: torch.Tensor, counters: torch.Tensor,
          args: np.ndarray, rope: np.ndarray | None = None) -> torch.Tensor:
    """One GEMV of `launch` (_Launch._gemv) with the handoff's arguments (and the rope's) in its first descriptor;
    `args` and `rope` stay alive through the C call. A consumer gathers its own rows (no pre-gathering launch)."""
    fields = {F_HANDOFF: args.ctypes.data}
    if rope is not None:
        fields[F_ROPE] = rope.ctypes.data
    return launch._gemv(x, ws, counters, gate_off, fields, pregather=args[0] == _OUT)


@torch.library.custom_op("exl2_backend::exl2_gemv_handoff_out", mutates_args=("ws", "counters"))
def _handoff_out_op(x: torch.Tensor, residual: torch.Tensor, packed: torch.Tensor, handle: int, ws: torch.Tensor,
                    counters: torch.Tensor, gated: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(y = GEMV(x) [M, N], r = y + residual [M, N], sq fp32 [M, ceil(N / 256)] sums of r^2 per column block);
    gated: x [M, 2K] holds gate | up and the input is silu(gate) * up."""
    launch = _REG[handle]
    k, n = launch.K, launch.out_features
    m = x.shape[0] if isinstance(x, torch.Tensor) and x.dim() == 2 else -1
    _check(x, "x", (m, 2 * k if gated else k), torch.float16, packed.device)
    _check(residual, "residual", (m, n), torch.float16, packed.device)
    if not can_handoff(launch, m, out=True):
        raise TensorShapeError(f"the norm handoff does not take {m} rows of this linear here", tensor="x")
    ncb = column_blocks(n)
    res_out = torch.empty_like(residual)
    sq = torch.empty((m, ncb), dtype=torch.float32, device=x.device)
    args = np.array([_OUT, residual.data_ptr(), _row_stride(residual), res_out.data_ptr(), _row_stride(res_out),
                     sq.data_ptr(), ncb, 0], dtype=np.int64)
    y = _gemv(launch, x, k if gated else 0, ws, counters, args)
    return y, res_out, sq


@_handoff_out_op.register_fake
def _(x, residual, packed, handle, ws, counters, gated):
    n = _REG[handle].out_features
    return (x.new_empty((x.shape[0], n)), residual.new_empty(residual.shape),
            x.new_empty((x.shape[0], column_blocks(n)), dtype=torch.float32))


def _in_args(launch: _Launch, r: torch.Tensor, sq: torch.Tensor, weight: torch.Tensor, eps: float,
             packed: torch.Tensor) -> tuple[int, np.ndarray]:
    """Checks the consuming GEMV's inputs (TensorShapeError); returns (M, the handoff's int64 arguments)."""
    k = launch.K
    m = r.shape[0] if isinstance(r, torch.Tensor) and r.dim() == 2 else -1
    _check(r, "r", (m, k), torch.float16, packed.device)
    _check(sq, "sq", (m, column_blocks(k)), torch.float32, packed.device)
    if not (isinstance(weight, torch.Tensor) and weight.shape == (k,) and weight.dtype == torch.float16
            and weight.device == packed.device and weight.is_contiguous()):
        raise TensorShapeError(f"the norm weight must be a contiguous float16 [{k}] tensor on {packed.device}",
                               tensor="weight")
    if not 0.0 < eps < 1.0:
        raise ValueError(f"eps must be in (0, 1), got {eps}")
    if not can_handoff(launch, m, out=False):
        raise TensorShapeError(f"the norm handoff does not take {m} rows of {k} here", tensor="r")
    eps_bits = int(np.array([eps], dtype=np.float32).view(np.uint32)[0])
    return m, np.array([_IN, sq.data_ptr(), sq.stride(0), sq.shape[1], weight.data_ptr(), eps_bits, k, 0],
                       dtype=np.int64)


@torch.library.custom_op("exl2_backend::exl2_gemv_handoff_in", mutates_args=("ws", "counters"))
def _handoff_in_op(r: torch.Tensor, sq: torch.Tensor, weight: torch.Tensor, eps: float, packed: torch.Tensor,
                   handle: int, ws: torch.Tensor, counters: torch.Tensor) -> torch.Tensor:
    """GEMV(rms_norm(r) * weight) [M, N] for the stream r [M, K] and its partial sums of squares sq [M, ncb]."""
    launch = _REG[handle]
    _, args = _in_args(launch, r, sq, weight, eps, packed)
    return _gemv(launch, r, 0, ws, counters, args)


@_handoff_in_op.register_fake
def _(r, sq, weight, eps, packed, handle, ws, counters):
    return r.new_empty((r.shape[0], _REG[handle].out_features))


@torch.library.custom_op("exl2_backend::exl2_gemv_handoff_in_rope_kv",
                         mutates_args=("ws", "counters", "k_cache", "v_cache"))
def _handoff_in_rope_kv_op(r: torch.Tensor, sq: torch.Tensor, weight: torch.Tensor, eps: float, packed: torch.Tensor,
                           handle: int, ws: torch.Tensor, counters: torch.Tensor, positions: torch.Tensor,
                           inv_freq: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           slots: torch.Tensor) -> torch.Tensor:
    """exl2_gemv_handoff_in of the q/k/v projection with rope_kv_write after it (as exl2_gemv_add_norm_rope_kv)."""
    launch = _REG[handle]
    m, args = _in_args(launch, r, sq, weight, eps, packed)
    rope = _rope_args(launch, m, positions, inv_freq, k_cache, v_cache, slots)
    return _gemv(launch, r, 0, ws, counters, args, rope)


@_handoff_in_rope_kv_op.register_fake
def _(r, sq, weight, eps, packed, handle, ws, counters, positions, inv_freq, k_cache, v_cache, slots):
    return r.new_empty((r.shape[0], _REG[handle].out_features))


def residual_handoff(op: CudaLinearOp, x: torch.Tensor, residual: torch.Tensor,
                     gated: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """(op(x) or op.gated(x), that + residual, sq) through the producing handoff; None where it does not apply."""
    m = x.shape[0] if x.dim() == 2 else 0
    if not (m and hasattr(op, "launch") and can_handoff(op.launch, m, out=True) and _rows_aligned(x)
            and residual.shape == (m, op.out_features) and _rows_aligned(residual)):
        return None
    ws, counters = op.workspace.buffers()
    launch = op.launch
    return torch.ops.exl2_backend.exl2_gemv_handoff_out(x, residual, launch.parts[0].packed, launch.handle, ws,
                                                        counters, gated)


def normed_handoff(op: CudaLinearOp, r: torch.Tensor, sq: torch.Tensor, weight: torch.Tensor, eps: float,
                   rope: tuple | None = None) -> torch.Tensor | None:
    """op(rms_norm(r) * weight) through the consuming handoff; rope = (positions, inv_freq, k_cache, v_cache,
    slots) also runs the q/k/v projection's rope and fp16 KV-cache write. None where it does not apply."""
    m = r.shape[0] if r.dim() == 2 else 0
    if not (m and hasattr(op, "launch") and can_handoff(op.launch, m, out=False) and _rows_aligned(r)
            and sq.dtype == torch.float32 and sq.shape == (m, column_blocks(op.in_features)) and sq.stride(1) == 1
            and weight.dtype == torch.float16 and weight.is_contiguous()):
        return None
    ws, counters = op.workspace.buffers()
    launch = op.launch
    if rope is None:
        return torch.ops.exl2_backend.exl2_gemv_handoff_in(r, sq, weight, float(eps), launch.parts[0].packed,
                                                           launch.handle, ws, counters)
    try:
        _rope_args(launch, m, *rope)
    except TensorShapeError:
        return None
    return torch.ops.exl2_backend.exl2_gemv_handoff_in_rope_kv(r, sq, weight, float(eps), launch.parts[0].packed,
                                                               launch.handle, ws, counters, *rope)
