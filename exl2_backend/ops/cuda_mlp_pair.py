"""The MLP's two GEMVs as a flag pair: down_proj's blocks start on the gate/up columns they read.

A decode layer's gate/up GEMV (post-attention norm fused) and the down GEMV after it (silu_mul in its gather) are
two launches. Under PDL each down block waits until the whole gate/up grid has finished, its slowest column block
included, although it reads only a K-slice of gate/up's output. As a flag pair (csrc/quant/exl2_gemv_flags.cuh)
gate/up publishes a ready flag per 256-column block and each down block polls the flags of the columns it gathers
instead. Both launches come from one call here, so the flags are always consumed by the launch they were set for.

Op: `exl2_backend::exl2_mlp_pair(h, residual, weight, eps, gu_packed, gu_handle, down_packed, down_handle, ws!,
counters!, flags!, pregather)` -> (down output [M, H], h + residual). `mlp_pair` is the model-facing entry: None
where the pair does not run (then the caller runs gate/up and down one by one). The outputs are those of the two
launches one by one, bit for bit: the same plans, the same arithmetic; only when each block starts differs.
"""

from __future__ import annotations

import os

import torch

from exl2_backend.errors import TensorShapeError
from exl2_backend.ops.cuda_quant import _GEMV_COLS, _REG, FLAG_BUFFER_INTS, CudaLinearOp, _check_norm_call

# Off by default until measured on the H200 (EXL2_BACKEND_MLP_FLAGS=1 turns it on).
MLP_FLAGS = os.environ.get("EXL2_BACKEND_MLP_FLAGS", "0") == "1"
MAX_M = 8  # the consumer gathers its input by items (csrc/quant/exl2_gemm.cu plan_flags)


def pair_takes(gate_up, down, m: int) -> bool:
    """Whether gate_up -> down can run as a flag pair for M rows: CUDA linears on one device, both on the TMA GEMV
    (sm_90+), down's input being gate_up's [gate | up] output with every part's columns on 256-column blocks, and
    down gathering that input itself (no pre-gather launch between them)."""
    if not (isinstance(gate_up, CudaLinearOp) and isinstance(down, CudaLinearOp) and 1 <= m <= MAX_M):
        return False
    gu, dn = gate_up.launch, down.launch
    if gate_up.device != down.device or gu.out_features != 2 * dn.K or len(gu.parts) != 2 or len(dn.parts) != 1:
        return False
    if any(off % _GEMV_COLS for off in gu.col_off) or -(-gu.out_features // _GEMV_COLS) >= FLAG_BUFFER_INTS:
        return False
    return gu.takes_gemv(m) and dn.takes_gemv(m) and not dn.pregathers(m)


def mlp_pair(gate_up, down, h: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
             eps: float) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(down(silu(gate) * up), h + residual) where (gate | up) = gate_up(rms_norm(h + residual) * weight), as a
    flag pair; None where it does not run (MLP_FLAGS off, pair_takes, or gate_up's fused-norm routing declines)."""
    m = h.shape[0] if h.dim() == 2 else 0
    if not (MLP_FLAGS and pair_takes(gate_up, down, m)):
        return None
    pregather = gate_up._norm_route(h, residual, weight, False, None)
    if pregather is None:
        return None
    ws_obj = gate_up.workspace
    need = gate_up.launch.gemv_plan(m).ws_numel + down.launch.gemv_plan(m).ws_numel
    ws, counters = ws_obj.buffers()
    if ws.numel() < need:
        if torch.cuda.is_current_stream_capturing():
            return None  # no allocation inside a capture: the warm-up before it reserves
        ws_obj.reserve(need)
        ws, counters = ws_obj.buffers()
    out, res = torch.ops.exl2_backend.exl2_mlp_pair(
        h, residual, weight, float(eps), gate_up.launch.parts[0].packed, gate_up.launch.handle,
        down.launch.parts[0].packed, down.launch.handle, ws, counters, ws_obj.flags, pregather)
    return out, (h if residual is None else res)


@torch.library.custom_op("exl2_backend::exl2_mlp_pair", mutates_args=("ws", "counters", "flags"))
def _mlp_pair_op(h: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float,
                 gu_packed: torch.Tensor, gu_handle: int, down_packed: torch.Tensor, down_handle: int,
                 ws: torch.Tensor, counters: torch.Tensor, flags: torch.Tensor,
                 pregather: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """gate/up's norm-fused GEMV (exl2_gemv_add_norm, `pregather` as there) publishing ready flags, then down's
    gated GEMV waiting on them. Its split-K partials and tickets follow gate/up's in ws and counters (both grids
    may run at once)."""
    gu, dn = _REG[gu_handle], _REG[down_handle]
    m = _check_norm_call(gu, h, residual, weight, gu_packed, pregather)
    if gu.out_features != 2 * dn.K or not 1 <= m <= MAX_M:
        raise TensorShapeError(f"the flag pair takes 1..{MAX_M} rows of a gate/up of {2 * dn.K} columns, got {m} rows "
                               f"of {gu.out_features}", tensor="h")
    nflags = -(-gu.out_features // _GEMV_COLS)
    if flags.dtype != torch.int32 or flags.numel() <= nflags or flags.device != h.device:
        raise TensorShapeError(f"flags must be int32 with more than {nflags} entries on {h.device}", tensor="flags")
    gu_plan = gu.gemv_plan(m)
    if ws.numel() < gu_plan.ws_numel + dn.gemv_plan(m).ws_numel:
        raise TensorShapeError(f"workspace holds {ws.numel()} floats, the pair needs "
                               f"{gu_plan.ws_numel + dn.gemv_plan(m).ws_numel}", tensor="ws")
    pair_flags = flags[: nflags + 1]  # the flags, then the count-in
    gate_up, res_out = gu.gemv_add_norm(h, residual, weight, eps, ws, counters, pregather, flags=pair_flags)
    gu_counters = sum(-(-p.Np // _GEMV_COLS) for p in gu.parts)
    out = dn._gemv(gate_up, ws[gu_plan.ws_numel:], counters[gu_counters:], gate_off=dn.K, wait_flags=pair_flags)
    return out, res_out


@_mlp_pair_op.register_fake
def _(h, residual, weight, eps, gu_packed, gu_handle, down_packed, down_handle, ws, counters, flags, pregather):
    res_out = h.new_empty(h.shape) if residual is not None else h.new_empty(0)
    return h.new_empty((h.shape[0], _REG[down_handle].out_features)), res_out
