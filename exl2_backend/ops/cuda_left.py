"""gate/up's split-K partials left to down's gather (csrc/quant/exl2_gemv_left.cuh).

The gate/up GEMV of a decode step splits K (two ways on the 8B), so the last block of each column block takes a
ticket and sums the partials before the launch ends: two round trips on the tail, while the DRAM idles. Here every
gate/up block stores its partial and exits, and down's gather sums them in split order, adds the bias and rounds,
as the skipped reduction would have, before silu_mul: down's input, its output and the residual stream are
bit-identical to the launches with the finish. Opt-in (EXL2_BACKEND_LEFT_PARTIALS=1) until a device call measures it
(session 37's model: -0.06 ms per 8B decode step).

Ops: `exl2_backend::exl2_gemv_add_norm_leave(h, residual, weight, eps, packed, handle, counters, pregather)` ->
(partials, residual out) and `exl2_backend::exl2_gemv_gated_left(partials, packed, handle, producer, ws!,
counters!)` -> [M, N]. `gate_up_down` is the model-facing entry: None where it does not run.
"""

from __future__ import annotations

import os

import numpy as np
import torch

from exl2_backend.errors import TensorShapeError
from exl2_backend.ops import cuda_quant, library
from exl2_backend.ops.cuda_quant import (
    _REG,
    CudaLinearOp,
    _check_norm_call,
    _fn,
    _Launch,
    _stream,
    gemv_row_cap,
)

LEFT_PARTIALS = os.environ.get("EXL2_BACKEND_LEFT_PARTIALS", "0") == "1"
# Rows it takes: a decode step and verify steps up to k = 7 (the partials of M rows take splits x M x N floats).
MAX_M = 8
MAX_SPLITS = 16  # per part; csrc/quant/exl2_gemv_left.cuh kLeftMaxSplits


def left_splits(launch: _Launch, m: int) -> list[int]:
    """Per part, the splits the TMA GEMV of M rows plans: how many partials it leaves (exl2_gemv_splits)."""
    pl = launch.gemv_plan(m)
    if pl.left_splits is None:
        pl.left_splits = [sum(runs) for runs in launch.gemv_splits(m)[0]]
    return pl.left_splits


def partials_layout(launch: _Launch, m: int) -> tuple[list[int], int]:
    """(offset of each part's partials, floats per token): part i's [splits][M][Np] block follows part i - 1's."""
    sizes = [k * m * p.Np for k, p in zip(left_splits(launch, m), launch.parts)]
    offsets = [sum(sizes[:i]) for i in range(len(sizes))]
    return offsets, sum(sizes) // m


def takes(gate_up, down, m: int) -> bool:
    """Whether gate/up can leave its partials to down at M rows: the switch; CUDA linears on one sm_90+ device that
    route M <= MAX_M rows to the GEMV; gate/up of two parts (gate, up) as wide as down's one part is deep; at most
    MAX_SPLITS splits a part."""
    if not (LEFT_PARTIALS and 1 <= m <= MAX_M and isinstance(gate_up, CudaLinearOp) and isinstance(down, CudaLinearOp)):
        return False
    gu, dn = gate_up.launch, down.launch
    if gu.device != dn.device or gemv_row_cap(gu.device) != 32 or cuda_quant.GEMV_MINB != 0:
        return False
    if len(gu.parts) != 2 or len(dn.parts) != 1 or gu.splits != [dn.K, dn.K]:
        return False
    return gu.takes_gemv(m) and dn.takes_gemv(m) and max(left_splits(gu, m)) <= MAX_SPLITS


def gate_up_down(gate_up, down, h: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float,
                 pregather: bool | None = None) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(down(silu(gate) * up) [M, H], h + residual) with gate/up = gate_up(rms_norm(h + residual) * weight), gate/up
    leaving its split-K partials to down (residual None: the norm of h, and h is returned as the stream). The norm
    is routed as CudaLinearOp.add_normed routes it (`pregather` True / False forces a route, for tests). None where
    it does not run (takes, or the norm's route declines): the caller runs the ops as usual."""
    m = h.shape[0] if h.dim() == 2 else 0
    if not takes(gate_up, down, m):
        return None
    route = gate_up._norm_route(h, residual, weight, False, pregather)
    if route is None:
        return None
    _, counters = gate_up.workspace.buffers()
    gu = gate_up.launch
    partials, res_out = torch.ops.exl2_backend.exl2_gemv_add_norm_leave(h, residual, weight, float(eps),
                                                                        gu.parts[0].packed, gu.handle, counters, route)
    ws, counters = down.workspace.buffers()
    out = torch.ops.exl2_backend.exl2_gemv_gated_left(partials, down.launch.parts[0].packed, down.launch.handle,
                                                      gu.handle, ws, counters)
    return out, (h if residual is None else res_out)


@torch.library.custom_op("exl2_backend::exl2_gemv_add_norm_leave", mutates_args=())
def _add_norm_leave_op(h: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float,
                       packed: torch.Tensor, handle: int, counters: torch.Tensor,
                       pregather: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """exl2_gemv_add_norm whose blocks leave their split-K partials: (partials fp32 [M, L], h + residual). The
    partials' memory holds each part's [splits][M][Np] block after the previous part's (partials_layout); the shape
    carries M. `counters` only keeps the split plan the one exl2_gemv_splits reports (it is not written)."""
    launch = _REG[handle]
    m = _check_norm_call(launch, h, residual, weight, packed, pregather)
    offsets, row = partials_layout(launch, m)
    partials = torch.empty(m, row, dtype=torch.float32, device=h.device)
    _, res_out = launch.gemv_add_norm(h, residual, weight, eps, partials, counters, pregather, leave_off=offsets)
    return partials, res_out


@_add_norm_leave_op.register_fake
def _(h, residual, weight, eps, packed, handle, counters, pregather):
    res_out = h.new_empty(h.shape) if residual is not None else h.new_empty(0)
    return h.new_empty((h.shape[0], partials_layout(_REG[handle], h.shape[0])[1]), dtype=torch.float32), res_out


def _left_args(producer: _Launch, partials: torch.Tensor, m: int) -> np.ndarray:
    """exl2_gemv_left's arguments: per producer part (gate, up) its partials, splits, row length and bias."""
    offsets, _ = partials_layout(producer, m)
    args = []
    for part, k, off in zip(producer.parts, left_splits(producer, m), offsets):
        args += [partials.data_ptr() + 4 * off, k, part.Np, 0 if part.bias is None else part.bias.data_ptr()]
    return np.array(args, dtype=np.int64)


@torch.library.custom_op("exl2_backend::exl2_gemv_gated_left", mutates_args=("ws", "counters"))
def _gated_left_op(partials: torch.Tensor, packed: torch.Tensor, handle: int, producer: int, ws: torch.Tensor,
                   counters: torch.Tensor) -> torch.Tensor:
    """The gated GEMV (down) over a producer's left partials (exl2_gemv_add_norm_leave's first output): [M, N], the
    output exl2_gemv_gated gives over the producer's reduced output."""
    launch, prod = _REG[handle], _REG[producer]
    m = partials.shape[0] if partials.dim() == 2 else 0
    if not 1 <= m <= MAX_M or partials.dtype != torch.float32 or partials.device != packed.device \
            or not partials.is_contiguous() or partials.shape[1] != partials_layout(prod, m)[1]:
        raise TensorShapeError(f"partials of shape {tuple(partials.shape)} ({partials.dtype}, {partials.device}) are "
                               f"not the producer's fp32 partials of 1..{MAX_M} rows on {packed.device}",
                               tensor="partials")
    if len(launch.parts) != 1 or prod.splits != [launch.K, launch.K]:
        raise TensorShapeError(f"a gated GEMV of K={launch.K} takes the partials of two parts of that width, got "
                               f"{prod.splits}", tensor="partials")
    out, blob = launch._bind(launch.gemv_plan(m), m, ws, counters, packed.device)
    args = _left_args(prod, partials, m)
    st = _fn("exl2_gemv_left")(blob.ctypes.data, 1, m, args.ctypes.data, cuda_quant.GEMV_MINB,
                               _stream(packed.device))
    library.check(st, "exl2_gemv_left")
    return out


@_gated_left_op.register_fake
def _(partials, packed, handle, producer, ws, counters):
    return partials.new_empty((partials.shape[0], _REG[handle].out_features), dtype=torch.float16)
