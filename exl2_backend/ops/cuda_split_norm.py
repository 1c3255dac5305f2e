"""RMSNorm split across the two TMA GEMVs around it (csrc/quant/exl2_gemv_norm_partials.cuh).

The GEMV that produces the hidden state (o_proj, down_proj: the *producer*) finishes the residual add in place and
leaves each row's sum of squares as one partial per 256-column block; the GEMV that consumes it (gate/up, the next
layer's q/k/v: the *consumer*) normalizes only its own split's rows from those partials. So a decode step runs no
norm launch and no GEMV block reads a whole row (the norm inside the consumer read all M rows of h and the
residual in each of its ~264 blocks; a verify step ran the norm as 65 launches of its own).

Every norm of the library sums squares in one order (csrc/layers/rms_ssq.cuh), so producer + consumer give the bits
of add_rms_norm between two plain GEMVs.
"""

from __future__ import annotations

import numpy as np
import torch

from exl2_backend.errors import TensorShapeError
from exl2_backend.ops import library

SSQ_BLOCK_COLS = 256  # columns per block partial (the GEMV's column block; rms_ssq.cuh kSsqBlockCols)

_fns: dict[str, object] = {}


def _fn(name: str):
    if name not in _fns:
        P, I32 = library.PTR, library.I32
        sig = {
            "exl2_gemv_residual": (P, I32, P, I32, I32, I32, P, I32, P, I32, P, I32, P, library.STREAM),
            "exl2_gemv_ssq_norm": (P, I32, P, I32, I32, P, I32, P, library.F32, P, I32, library.STREAM),
        }[name]
        _fns[name] = library.declare(name, *sig)
    return _fns[name]


def ssq_blocks(n: int) -> int:
    """Block partials per row of n columns."""
    return -(-n // SSQ_BLOCK_COLS)


def takes_split_norm(launch, m: int) -> bool:
    """Whether M rows of `launch` (a cuda_quant._Launch) run the TMA GEMV that the split norm needs, on either side:
    the TMA kernel (sm_90+, GEMV_MINB 0) takes M, and the rows are whole 16-byte vectors."""
    from exl2_backend.ops import cuda_quant

    return (cuda_quant.GEMV_MINB == 0 and cuda_quant.gemv_row_cap(launch.device) == 32 and launch.takes_gemv(m)
            and launch.K % 8 == 0 and launch.out_features % 8 == 0)


def stored_order_maps(launch) -> torch.Tensor:
    """int16 [parts, K] (uint16 bits): for each part of `launch` (a consumer), input feature -> its stored row, for
    the producer's scatter into the consumer's stored order. Built once per launch."""
    inv = getattr(launch, "_split_norm_inv", None)
    if inv is None:
        rows = []
        for p in launch.parts:
            xm = p.xmap.long() & 0xFFFF  # [Kpad] stored row -> feature (0xFFFF: padding)
            valid = xm != 0xFFFF
            r = torch.zeros(launch.K, dtype=torch.int64, device=xm.device)
            r[xm[valid]] = torch.arange(xm.numel(), device=xm.device)[valid]
            rows.append(r)
        inv = torch.stack(rows)  # [parts, K], rows 16-byte aligned (K % 8 == 0)
        inv = torch.where(inv >= 32768, inv - 65536, inv).to(torch.int16).contiguous()
        launch._split_norm_inv = inv
    return inv


def _stream(device: torch.device) -> int:
    return torch.cuda.current_stream(device).cuda_stream


def produce(launch, x: torch.Tensor, residual: torch.Tensor, ws: torch.Tensor, counters: torch.Tensor,
            gate_off: int = 0, consumer=None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(round(GEMV(x) + residual) [M, N] fp16, ssq [M, ceil(N / 256)] fp32, xp): the producer side. gate_off > 0: x
    holds gate and up, the input is silu(gate) * up (cuda_quant's gated GEMV). consumer (a _Launch of in_features
    N): xp fp16 [parts, M, consumer.kpad] receives the stream in its parts' stored row order (padding rows
    unwritten), else xp is empty."""
    from exl2_backend.ops.cuda_quant import _row_stride

    m = x.shape[0]
    pl = launch.gemv_plan(m)
    out, blob = launch._bind(pl, m, ws, counters, x.device)
    ssq = torch.empty(m, ssq_blocks(launch.out_features), dtype=torch.float32, device=x.device)
    ldx, stream = _row_stride(x), _stream(x.device)
    pre, ld = None, 0
    if launch.pregathers(m):
        pre, ld = launch._stored_order_buffer(m, x.device)
        from exl2_backend.ops.cuda_quant import _fn as quant_fn

        st = quant_fn("exl2_gemv_pregather")(blob.ctypes.data, len(launch.parts), x.data_ptr(), m, ldx, gate_off,
                                             pre.data_ptr(), ld, stream)
        library.check(st, "exl2_gemv_pregather")
    xp, scatter = x.new_empty(0), None
    if consumer is not None:
        inv = stored_order_maps(consumer)
        xp = x.new_empty((len(consumer.parts), m, consumer.kpad))
        scatter = np.array([xp.data_ptr(), consumer.kpad, len(consumer.parts)]
                           + [inv[q].data_ptr() for q in range(len(consumer.parts))], dtype=np.int64)
    st = _fn("exl2_gemv_residual")(blob.ctypes.data, len(launch.parts), x.data_ptr(), m, ldx, gate_off,
                                   None if pre is None else pre.data_ptr(), ld, residual.data_ptr(),
                                   _row_stride(residual), ssq.data_ptr(), ssq.shape[1],
                                   None if scatter is None else scatter.ctypes.data, stream)
    library.check(st, "exl2_gemv_residual")
    return out, ssq, xp


def consume(launch, x: torch.Tensor, ssq: torch.Tensor, weight: torch.Tensor, eps: float, ws: torch.Tensor,
            counters: torch.Tensor, xp: torch.Tensor | None = None, rope: np.ndarray | None = None) -> torch.Tensor:
    """GEMV(rms_norm(x) * weight) [M, N] with x's sums of squares from the producer's partials: the consumer side.
    xp: the producer's stored-order copy of x (copied with 16-byte loads instead of gathered); rope: the fused rope's
    arguments (cuda_quant._rope_args), applied after the GEMV's output."""
    from exl2_backend.ops.cuda_quant import F_ROPE, _row_stride

    m = x.shape[0]
    out, blob = launch._bind(launch.gemv_plan(m), m, ws, counters, x.device)
    if rope is not None:
        blob[0, F_ROPE] = rope.ctypes.data  # read by the C call below, while `rope` is alive
    st = _fn("exl2_gemv_ssq_norm")(blob.ctypes.data, len(launch.parts), x.data_ptr(), m, _row_stride(x),
                                   ssq.data_ptr(), ssq.shape[1], weight.data_ptr(), float(eps),
                                   None if xp is None else xp.data_ptr(), 0 if xp is None else launch.kpad,
                                   _stream(x.device))
    library.check(st, "exl2_gemv_ssq_norm")
    return out


def _check_half_rows(t, name: str, m: int, k: int, device: torch.device) -> None:
    if not (isinstance(t, torch.Tensor) and t.dtype == torch.float16 and t.device == device and t.dim() == 2
            and t.shape == (m, k) and t.stride(1) == 1 and t.data_ptr() % 16 == 0
            and (m == 1 or t.stride(0) % 8 == 0)):
        raise TensorShapeError(f"{name} must be a float16 [{m}, {k}] tensor on {device} with contiguous rows starting "
                               "16-byte aligned", tensor=name)


def check_producer(launch, x: torch.Tensor, residual: torch.Tensor, gate_off: int, device: torch.device) -> int:
    """Checks a producer call (TensorShapeError); returns M."""
    if len(launch.parts) != 1:
        raise TensorShapeError(f"the producer GEMV takes one part, got {len(launch.parts)}", tensor="x")
    m = x.shape[0] if isinstance(x, torch.Tensor) and x.dim() == 2 else -1
    width = launch.K + gate_off
    if not (isinstance(x, torch.Tensor) and x.dtype == torch.float16 and x.device == device and x.dim() == 2
            and x.shape[1] == (2 * launch.K if gate_off else launch.K) and x.stride(1) == 1 and m >= 1):
        raise TensorShapeError(f"x must be a float16 [M, {width}] tensor on {device} with contiguous rows", tensor="x")
    if not takes_split_norm(launch, m) or launch.out_features % 8:
        raise TensorShapeError(f"the producer GEMV does not take {m} rows of {launch.K} -> {launch.out_features} "
                               "here", tensor="x")
    _check_half_rows(residual, "residual", m, launch.out_features, device)
    return m


def check_consumer(launch, x: torch.Tensor, ssq: torch.Tensor, weight: torch.Tensor, device: torch.device,
                   xp: torch.Tensor | None = None) -> int:
    """Checks a consumer call (TensorShapeError); returns M."""
    k = launch.K
    m = x.shape[0] if isinstance(x, torch.Tensor) and x.dim() == 2 else -1
    _check_half_rows(x, "x", m, k, device)
    if not takes_split_norm(launch, m):
        raise TensorShapeError(f"the split norm's consumer GEMV does not take {m} rows of {k} here", tensor="x")
    nb = ssq_blocks(k)
    if not (isinstance(ssq, torch.Tensor) and ssq.dtype == torch.float32 and ssq.device == device
            and ssq.shape == (m, nb) and ssq.is_contiguous()):
        raise TensorShapeError(f"ssq must be a contiguous float32 [{m}, {nb}] tensor on {device}", tensor="ssq")
    if not (isinstance(weight, torch.Tensor) and weight.shape == (k,) and weight.dtype == torch.float16
            and weight.device == device and weight.is_contiguous()):
        raise TensorShapeError(f"the norm weight must be a contiguous float16 [{k}] tensor on {device}",
                               tensor="weight")
    shape = (len(launch.parts), m, launch.kpad)
    if xp is not None and not (isinstance(xp, torch.Tensor) and xp.dtype == torch.float16 and xp.device == device
                               and xp.shape == shape and xp.is_contiguous() and xp.data_ptr() % 16 == 0):
        raise TensorShapeError(f"xp must be a contiguous float16 {list(shape)} tensor on {device} (the producer's "
                               "stored-order copy for this consumer)", tensor="xp")
    return m


# --- custom ops --------------------------------------------------------------------------------------------


def _launch(handle: int):
    from exl2_backend.ops.cuda_quant import _REG

    return _REG[handle]


@torch.library.custom_op("exl2_backend::exl2_gemv_residual", mutates_args=("ws", "counters"))
def _residual_op(x: torch.Tensor, residual: torch.Tensor, packed: torch.Tensor, handle: int, ws: torch.Tensor,
                 counters: torch.Tensor, gate_off: int,
                 consumer: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(round(GEMV(x) + residual), block partials of its rows' sums of squares, the stream in the stored order of
    launch `consumer` or empty for -1); gate_off > 0: x is gate | up and the GEMV's input silu(gate) * up."""
    launch = _launch(handle)
    check_producer(launch, x, residual, gate_off, packed.device)
    target = None
    if consumer >= 0:
        target = _launch(consumer)
        if target.K != launch.out_features or target.K % 8:
            raise TensorShapeError(f"the consumer takes {target.K} features, the producer writes {launch.out_features}",
                                   tensor="x")
    return produce(launch, x, residual, ws, counters, gate_off, target)


@_residual_op.register_fake
def _(x, residual, packed, handle, ws, counters, gate_off, consumer):
    n, m = _launch(handle).out_features, x.shape[0]
    xp = x.new_empty(0) if consumer < 0 else x.new_empty((len(_launch(consumer).parts), m, _launch(consumer).kpad))
    return x.new_empty((m, n)), x.new_empty((m, ssq_blocks(n)), dtype=torch.float32), xp


@torch.library.custom_op("exl2_backend::exl2_gemv_ssq_norm", mutates_args=("ws", "counters"))
def _ssq_norm_op(x: torch.Tensor, ssq: torch.Tensor, weight: torch.Tensor, eps: float, packed: torch.Tensor,
                 handle: int, ws: torch.Tensor, counters: torch.Tensor, xp: torch.Tensor | None) -> torch.Tensor:
    """GEMV(rms_norm(x) * weight), x's sums of squares from the producer's block partials `ssq`; xp: the producer's
    stored-order copy of x (None: gathered from x)."""
    launch = _launch(handle)
    check_consumer(launch, x, ssq, weight, packed.device, xp)
    return consume(launch, x, ssq, weight, eps, ws, counters, xp)


@_ssq_norm_op.register_fake
def _(x, ssq, weight, eps, packed, handle, ws, counters, xp):
    return x.new_empty((x.shape[0], _launch(handle).out_features))


@torch.library.custom_op("exl2_backend::exl2_gemv_ssq_norm_rope_kv",
                         mutates_args=("ws", "counters", "k_cache", "v_cache"))
def _ssq_norm_rope_kv_op(x: torch.Tensor, ssq: torch.Tensor, weight: torch.Tensor, eps: float, packed: torch.Tensor,
                         handle: int, ws: torch.Tensor, counters: torch.Tensor, xp: torch.Tensor | None,
                         positions: torch.Tensor, inv_freq: torch.Tensor, k_cache: torch.Tensor,
                         v_cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """exl2_gemv_ssq_norm of the q/k/v projection with rope_kv_write fused after it (as
    exl2_gemv_add_norm_rope_kv): q rotated in place, rotated k and v written into the fp16 caches at `slots`."""
    from exl2_backend.ops.cuda_quant import _rope_args

    launch = _launch(handle)
    m = check_consumer(launch, x, ssq, weight, packed.device, xp)
    rope = _rope_args(launch, m, positions, inv_freq, k_cache, v_cache, slots)
    return consume(launch, x, ssq, weight, eps, ws, counters, xp, rope)


@_ssq_norm_rope_kv_op.register_fake
def _(x, ssq, weight, eps, packed, handle, ws, counters, xp, positions, inv_freq, k_cache, v_cache, slots):
    return x.new_empty((x.shape[0], _launch(handle).out_features))
