"""The captured greedy decode step's host I/O on the GPU (csrc/layers/decode_io.cu, runtime/greedy_graphs.py):
kernels that read the step's staging rows from pinned host memory and write the greedy tokens back into it, so
a decode step with the lookahead is one graph launch (no staging upload, token copy or readback beside it).

Pinned host memory is read and written through its device address (`MappedHost`, looked up once, outside any
graph capture; with unified addressing it is the pointer itself). Each call checks its tensors."""

from __future__ import annotations

import ctypes
from typing import NamedTuple

import torch

from exl2_backend.ops import library
from exl2_backend.ops.cuda_layers import _require, launch_sampler, zero_temperatures
from exl2_backend.ops.library import I32, I64, PTR, STREAM
from exl2_backend.ops.reference_decode_io import STAGE_FIELDS


def _pinned(op: str, name: str, t: torch.Tensor, shape: tuple[int, ...]) -> None:
    # is_pinned() asks the runtime about the pointer, which a capture may forbid; under capture the MappedHost
    # the view came from has checked it
    _require(isinstance(t, torch.Tensor) and t.device.type == "cpu"
             and (torch.cuda.is_current_stream_capturing() or t.is_pinned()),
             f"{op}: {name} must be a pinned CPU tensor", name)
    _require(t.dtype == torch.int64 and tuple(t.shape) == shape and t.is_contiguous(),
             f"{op}: {name} must be contiguous int64 {list(shape)}, got {t.dtype} {tuple(t.shape)}", name)


def _on(op: str, name: str, t: torch.Tensor, dtype: torch.dtype, shape: tuple[int, ...], device) -> None:
    _require(isinstance(t, torch.Tensor) and t.device == device, f"{op}: {name} must be on {device}", name)
    _require(t.dtype == dtype and tuple(t.shape) == shape, f"{op}: {name} must be {dtype} {list(shape)}, got "
             f"{t.dtype} {tuple(t.shape)}", name)


def mapped_address(host: torch.Tensor) -> int:
    """The device address of a pinned CPU tensor's data (KernelUnavailableError when it is not mapped). Not
    during a graph capture: the lookup is a runtime call the capture may forbid."""
    _require(isinstance(host, torch.Tensor) and host.device.type == "cpu" and host.is_pinned(),
             "mapped_address: needs a pinned CPU tensor", "host")
    fn = library.declare("exl2_mapped_pointer", PTR, ctypes.POINTER(ctypes.c_void_p))
    out = ctypes.c_void_p()
    library.check(fn(host.data_ptr(), ctypes.byref(out)), "exl2_mapped_pointer")
    return int(out.value)


class MappedView(NamedTuple):
    """A view of pinned host memory and the device address of its first element."""

    tensor: torch.Tensor
    address: int


class MappedHost:
    """A pinned CPU tensor whose device address is looked up once; `view` gives its views' addresses."""

    def __init__(self, tensor: torch.Tensor):
        self.tensor = tensor
        self._base = mapped_address(tensor)
        self._start = tensor.data_ptr()
        storage = tensor.untyped_storage()
        self._end = storage.data_ptr() + storage.nbytes()

    def view(self, t: torch.Tensor) -> MappedView:
        """t: a view of this tensor (e.g. `host.tensor[p, :b]`)."""
        _require(t.device.type == "cpu" and self._start <= t.data_ptr() < self._end
                 and t.untyped_storage().data_ptr() == self.tensor.untyped_storage().data_ptr(),
                 "MappedHost.view: not a view of this tensor", "host")
        return MappedView(t, self._base + t.data_ptr() - self._start)


def decode_inputs(stage_view: MappedView, prev_view: MappedView | None, ids: torch.Tensor, pos: torch.Tensor,
                  lens: torch.Tensor, slots: torch.Tensor, tables: torch.Tensor) -> None:
    """reference_decode_io.decode_inputs on the GPU, into the given static inputs: stage pinned int64 [B, 4 + W],
    prev pinned int64 [B] or None (MappedHost views); ids, pos int64 [B, 1], lens int32 [B], slots int64 [B],
    tables int32 [B, W] (row stride may be wider) on one CUDA device. One launch on the current stream; no host
    sync."""
    op = "decode_inputs"
    stage = stage_view.tensor
    _require(isinstance(stage, torch.Tensor) and stage.dim() == 2 and stage.shape[1] >= STAGE_FIELDS,
             f"{op}: stage must be [B, 4 + W]", "stage")
    b, w = stage.shape[0], stage.shape[1] - STAGE_FIELDS
    _pinned(op, "stage", stage, (b, w + STAGE_FIELDS))
    if prev_view is not None:
        _pinned(op, "prev", prev_view.tensor, (b,))
    _require(isinstance(ids, torch.Tensor) and ids.is_cuda, f"{op}: ids must be a CUDA tensor", "ids")
    dev = ids.device
    for name, t, dtype, shape in (("ids", ids, torch.int64, (b, 1)), ("pos", pos, torch.int64, (b, 1)),
                                  ("lens", lens, torch.int32, (b,)), ("slots", slots, torch.int64, (b,)),
                                  ("tables", tables, torch.int32, (b, w))):
        _on(op, name, t, dtype, shape, dev)
    _require(ids.stride(0) == 1 and pos.stride(0) == 1 and lens.stride(0) == 1 and slots.stride(0) == 1
             and (w == 0 or tables.stride(1) == 1), f"{op}: outputs must be dense along their rows", "tables")
    if b == 0:
        return
    fn = library.declare("exl2_decode_inputs", PTR, I64, PTR, PTR, PTR, PTR, PTR, PTR, I64, I32, I32, STREAM)
    with torch.cuda.device(dev):
        library.check(fn(stage_view.address, stage.stride(0), prev_view.address if prev_view is not None else None,
                         ids.data_ptr(), pos.data_ptr(), lens.data_ptr(), slots.data_ptr(), tables.data_ptr(),
                         tables.stride(0), b, w, torch.cuda.current_stream(dev).cuda_stream), "exl2_decode_inputs")


def greedy_tokens_to_host(logits: torch.Tensor, host_view: MappedView) -> None:
    """ops.greedy_tokens with its int64 [B] tokens written straight into pinned host memory (a MappedHost view,
    [B]): the sampler kernel's last CTA of each row stores through the mapped address. Visible to the host once
    the stream has passed the kernel (an event after it)."""
    op = "greedy_tokens_to_host"
    _require(isinstance(logits, torch.Tensor) and logits.is_cuda and logits.dim() == 2
             and logits.dtype == torch.float32, f"{op}: logits must be f32 [B, V] on a CUDA device", "logits")
    b, v = logits.shape
    _require(v > 0, f"{op}: empty vocabulary", "logits")
    _pinned(op, "host", host_view.tensor, (b,))
    if b == 0:
        return
    logits = logits if logits.stride(1) == 1 else logits.contiguous()
    launch_sampler(logits, logits, zero_temperatures(logits.device, b), None, host_view.address)
