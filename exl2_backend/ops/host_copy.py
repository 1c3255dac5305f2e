"""Host-built tensors to a device without waiting for it: through pinned memory for a GPU (a copy from pageable
memory syncs the stream, which would stall the decode lookahead's queued step behind the one in flight)."""

from __future__ import annotations

import torch


def staging(shape, dtype: torch.dtype, device: torch.device, fill=0) -> torch.Tensor:
    """A CPU tensor to fill on the host and then `upload` to `device` (pinned when that is a GPU)."""
    return torch.full(shape, fill, dtype=dtype, pin_memory=device.type == "cuda")


def upload(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A CPU tensor built for `device` (pinned when that is a GPU) -> on `device`, without a host sync."""
    return host.to(device, non_blocking=True) if device.type == "cuda" else host.to(device)


def to_device(values, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Host values (a list, nested lists) -> a tensor on `device`, copied without a host sync."""
    host = torch.tensor(values, dtype=dtype)
    return upload(host.pin_memory() if device.type == "cuda" else host, device)
