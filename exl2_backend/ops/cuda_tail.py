"""The next GEMV's input norm as the tail of the GEMV that produces its input (csrc/quant/exl2_gemv_tail.cuh).

A verify step's rows (M = 3..8 at hidden 4096) are too many for the norm inside the consuming GEMV, so o and down
were each followed by exl2_add_norm_pregather and then the consumer (gate/up, the next layer's q/k/v): a launch
boundary more per norm, 64 per 8B step. H100 call BH1 of 2026-12-06 timed the verify step without those launches
(results wrong): k = 4 1.146 / 1.141 of a decode step against 1.245 / 1.263. Here the producing GEMV's last blocks
do the norm's work after every block's finish, and the consumer copies its pre-gathered rows: bit-identical to
producer + exl2_add_norm_pregather + consumer. Opt-in (`EXL2_BACKEND_NORM_TAIL=1`) until measured on the GPU.

Ops: `exl2_backend::exl2_gemv_norm_tail(x, gate_off, residual, weight, eps, packed, handle, ws!, counters!,
c_packed, c_handle, tail_cnt!) -> (h, residual_out, pre)` and `exl2_backend::exl2_gemv_pregathered(pre, h, packed,
handle, ws!, counters!)` (`..._rope_kv` with the q/k/v GEMV's fused rope and KV write). `linear_norm_linear` is the
model-facing entry: None where the pair does not run this way (the caller then runs the ops as before).
"""

from __future__ import annotations

import os

import torch

from exl2_backend.errors import TensorShapeError
from exl2_backend.ops.cuda_quant import (
    _REG,
    NORM_PREGATHER,
    CudaLinearOp,
    _check_norm_input,
    _check_norm_weight,
    _rope_args,
    _rows_aligned,
    gemv_row_cap,
)

NORM_TAIL = os.environ.get("EXL2_BACKEND_NORM_TAIL", "0") == "1"
MAX_M = 8  # one token tile: the tail is compiled into the M <= 8 kernel only


def _pre_numel(c_handle: int, m: int) -> int:
    launch = _REG[c_handle]
    return len(launch.parts) * m * launch.kpad


@torch.library.custom_op("exl2_backend::exl2_gemv_norm_tail", mutates_args=("ws", "counters", "tail_cnt"))
def _gemv_norm_tail_op(x: torch.Tensor, gate_off: int, residual: torch.Tensor | None, weight: torch.Tensor,
                       eps: float, packed: torch.Tensor, handle: int, ws: torch.Tensor, counters: torch.Tensor,
                       c_packed: torch.Tensor, c_handle: int,
                       tail_cnt: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(h = the GEMV of x [M, K] (gate_off > 0: of silu(x[:, :K]) * x[:, gate_off:]), h + residual (empty without a
    residual), the consumer's input rms_norm(h + residual) * weight in its stored row order [parts * M * ld])."""
    launch, consumer = _REG[handle], _REG[c_handle]
    m = _check_tail_call(launch, consumer, x, gate_off, residual, weight, tail_cnt)
    h, res_out, pre, _ = launch.gemv_tail(x, gate_off, ws, counters, residual, weight, eps, consumer, tail_cnt)
    del m
    return h, res_out, pre


@_gemv_norm_tail_op.register_fake
def _(x, gate_off, residual, weight, eps, packed, handle, ws, counters, c_packed, c_handle, tail_cnt):
    m, n = x.shape[0], _REG[handle].out_features
    res_out = x.new_empty((m, n)) if residual is not None else x.new_empty(0)
    return x.new_empty((m, n)), res_out, x.new_empty(_pre_numel(c_handle, m))


@torch.library.custom_op("exl2_backend::exl2_gemv_pregathered", mutates_args=("ws", "counters"))
def _gemv_pregathered_op(pre: torch.Tensor, h: torch.Tensor, packed: torch.Tensor, handle: int, ws: torch.Tensor,
                         counters: torch.Tensor) -> torch.Tensor:
    """The GEMV of pre (exl2_gemv_norm_tail's consumer input) for the M rows of h [M, K]."""
    launch = _REG[handle]
    _check_pre(launch, pre, h)
    return launch.gemv_pregathered(pre, launch.kpad, h, ws, counters)


@_gemv_pregathered_op.register_fake
def _(pre, h, packed, handle, ws, counters):
    return h.new_empty((h.shape[0], _REG[handle].out_features))


@torch.library.custom_op("exl2_backend::exl2_gemv_pregathered_rope_kv",
                         mutates_args=("ws", "counters", "k_cache", "v_cache"))
def _gemv_pregathered_rope_kv_op(pre: torch.Tensor, h: torch.Tensor, packed: torch.Tensor, handle: int,
                                 ws: torch.Tensor, counters: torch.Tensor, positions: torch.Tensor,
                                 inv_freq: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                                 slots: torch.Tensor) -> torch.Tensor:
    """exl2_gemv_pregathered of the q/k/v projection with rope_kv_write fused after it (as
    exl2_gemv_add_norm_rope_kv)."""
    launch = _REG[handle]
    _check_pre(launch, pre, h)
    rope = _rope_args(launch, h.shape[0], positions, inv_freq, k_cache, v_cache, slots)
    return launch.gemv_pregathered(pre, launch.kpad, h, ws, counters, rope)


@_gemv_pregathered_rope_kv_op.register_fake
def _(pre, h, packed, handle, ws, counters, positions, inv_freq, k_cache, v_cache, slots):
    return h.new_empty((h.shape[0], _REG[handle].out_features))


def _check_tail_call(launch, consumer, x, gate_off, residual, weight, tail_cnt) -> int:
    """TensorShapeError unless the pair runs exl2_gemv_tail; returns M."""
    dev = launch.parts[0].packed.device
    if not isinstance(x, torch.Tensor) or x.dim() != 2 or x.dtype != torch.float16 or x.device != dev:
        raise TensorShapeError(f"x must be a float16 [M, K] tensor on {dev}", tensor="x")
    m, k, n = x.shape[0], launch.K, launch.out_features
    if x.shape[1] != (k if gate_off == 0 else gate_off + k) or x.stride(-1) != 1 or (gate_off and gate_off < k):
        raise TensorShapeError(f"x has shape {tuple(x.shape)}, expected [M, {k}] (gated: [M, gate_off + {k}])",
                               tensor="x")
    if len(launch.parts) != 1 or not 1 <= m <= MAX_M or not launch.takes_gemv(m):
        raise TensorShapeError(f"the norm tail takes one part and 1..{MAX_M} rows the TMA GEMV runs, got "
                               f"{len(launch.parts)} parts and {m} rows", tensor="x")
    if consumer.K != n or consumer.parts[0].packed.device != dev:
        raise TensorShapeError(f"the consumer takes {consumer.K} features on {consumer.parts[0].packed.device}, the "
                               f"producer writes {n} on {dev}", tensor="weight")
    if residual is not None:
        _check_norm_input(residual, "residual", n, m, dev)
    _check_norm_weight(weight, n, dev)
    if not (isinstance(tail_cnt, torch.Tensor) and tail_cnt.dtype == torch.int32 and tail_cnt.numel() >= 2
            and tail_cnt.device == dev and tail_cnt.is_contiguous()):
        raise TensorShapeError("tail_cnt must be a contiguous int32 tensor of two zeros on the device",
                               tensor="tail_cnt")
    return m


def _check_pre(launch, pre: torch.Tensor, h: torch.Tensor) -> None:
    dev = launch.parts[0].packed.device
    if not isinstance(h, torch.Tensor) or h.dim() != 2 or h.shape[1] != launch.K or h.device != dev:
        raise TensorShapeError(f"h must be an [M, {launch.K}] tensor on {dev}", tensor="h")
    need = len(launch.parts) * h.shape[0] * launch.kpad
    if not (isinstance(pre, torch.Tensor) and pre.dtype == torch.float16 and pre.device == dev
            and pre.is_contiguous() and pre.numel() >= need and pre.data_ptr() % 16 == 0):
        raise TensorShapeError(f"pre must be a contiguous float16 tensor of >= {need} elements on {dev}",
                               tensor="pre")


def takes(producer, consumer, m: int) -> bool:
    """Whether producer -> norm -> consumer of M rows runs as the tail: both CUDA linears on one sm_90+ device, the
    producer of one part routing M <= 8 rows to the TMA GEMV, and the consumer's norm taking the pre-gathering route
    at M (add_normed: rows past one pass of the fused norm). A wrapper is not a CudaLinearOp: tensor parallel's
    GatherInput / ReduceOutput (model/tensor_parallel.py) must all-gather or all-reduce between the GEMV and the norm,
    which the tail would skip."""
    if not (isinstance(producer, CudaLinearOp) and isinstance(consumer, CudaLinearOp)):
        return False
    pl, cl = producer.launch, consumer.launch
    return (NORM_PREGATHER and 1 <= m <= MAX_M and len(pl.parts) == 1 and producer.device == consumer.device
            and gemv_row_cap(producer.device) == 32 and pl.takes_gemv(m) and cl.K == pl.out_features
            and cl.can_norm_pregather(m) and not cl.takes_norm(m))


def linear_norm_linear(producer, x: torch.Tensor, consumer, residual: torch.Tensor | None, weight: torch.Tensor,
                       eps: float, gated: bool = False, rope: dict | None = None):
    """(consumer(rms_norm(producer(x) + residual) * weight), producer(x) + residual, roped), with gated: producer
    applied to silu(gate) * up of x = gate | up. rope: the q/k/v consumer's fused rope and KV write (positions,
    inv_freq, k_cache, v_cache, slots); roped says whether it ran (not where the consumer's heads or the cache do not
    fit it: then the caller rotates and writes the cache). None where the pair does not run this way (takes, or
    unaligned / mistyped tensors)."""
    m = x.shape[0] if x.dim() == 2 else 0
    if not (NORM_TAIL and takes(producer, consumer, m) and x.dtype == torch.float16
            and weight.dtype == torch.float16 and weight.is_contiguous() and weight.data_ptr() % 16 == 0
            and (residual is None or (residual.dtype == torch.float16 and _rows_aligned(residual)))):
        return None
    k = producer.in_features
    gate_off = 0
    if gated:
        if not (x.shape[1] == 2 * k and x.stride(-1) == 1 and x.stride(0) == 2 * k):
            return None
        gate_off = k
    elif x.stride(-1) != 1:
        return None
    pl, cl = producer.launch, consumer.launch
    if rope is not None:
        try:
            _rope_args(cl, m, rope["positions"], rope["inv_freq"], rope["k_cache"], rope["v_cache"], rope["slots"])
        except TensorShapeError:
            rope = None
    ws, counters = producer.workspace.buffers()
    h, res_out, pre = torch.ops.exl2_backend.exl2_gemv_norm_tail(
        x, gate_off, residual, weight, float(eps), pl.parts[0].packed, pl.handle, ws, counters, cl.parts[0].packed,
        cl.handle, producer.tail_counters())
    if rope is None:
        y = torch.ops.exl2_backend.exl2_gemv_pregathered(pre, h, cl.parts[0].packed, cl.handle, ws, counters)
    else:
        y = torch.ops.exl2_backend.exl2_gemv_pregathered_rope_kv(
            pre, h, cl.parts[0].packed, cl.handle, ws, counters, rope["positions"], rope["inv_freq"],
            rope["k_cache"], rope["v_cache"], rope["slots"])
    return y, (h if residual is None else res_out), rope is not None
