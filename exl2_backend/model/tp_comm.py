"""Collectives of tensor parallelism over torch.distributed: NCCL between GPUs, gloo between CPU processes
(tests). One process per rank; rank r uses cuda:r. The NVLink-multicast paths (NVLS, symmetric-memory
multicast, NVSHMEM NVLS) are switched off before NCCL starts: the lent multi-GPU machines do not support them
(the device README says why), and NCCL would otherwise try them during communicator setup.
"""

from __future__ import annotations

import os
import socket
from datetime import timedelta

import torch
import torch.distributed as dist

from exl2_backend.errors import ConfigError

MULTICAST_OFF = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
# A rank stuck in a collective (its peer died) fails after this many seconds instead of hanging.
TIMEOUT_S = float(os.environ.get("EXL2_BACKEND_TP_TIMEOUT_S", "600"))


def disable_multicast_env() -> None:
    """Set MULTICAST_OFF in this process's environment (before any NCCL communicator exists)."""
    os.environ.update(MULTICAST_OFF)


def free_port() -> int:
    """A free TCP port on 127.0.0.1 for the process group's rendezvous."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Collective:
    """The two collectives a tensor-parallel layer needs, on the default process group."""

    def __init__(self, rank: int, world: int, backend: str):
        self.rank, self.world, self.backend = rank, world, backend

    def all_gather_cols(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, F] on every rank -> [T, world * F]: rank r's block in columns [r F, (r+1) F)."""
        x = x.contiguous()
        t, f = x.shape
        if self.backend == "nccl":
            out = torch.empty(self.world * t, f, dtype=x.dtype, device=x.device)  # [world * T, F]
            dist.all_gather_into_tensor(out, x)
        else:
            parts = [torch.empty_like(x) for _ in range(self.world)]
            dist.all_gather(parts, x)
            out = torch.cat(parts, dim=0)
        return out.view(self.world, t, f).transpose(0, 1).reshape(t, self.world * f)

    def all_reduce_(self, x: torch.Tensor) -> torch.Tensor:
        """Sum x over the ranks, in place."""
        dist.all_reduce(x)
        return x


def init_rank(rank: int, world: int, port: int, device_type: str) -> Collective:
    """Join the process group of `world` ranks (rendezvous on 127.0.0.1:port). One per process."""
    if dist.is_initialized():
        raise ConfigError("this process already belongs to a torch.distributed process group: one tensor-parallel "
                          "engine per process (close the other engine first)", field="tensor_parallel")
    disable_multicast_env()
    backend = "nccl" if device_type == "cuda" else "gloo"
    kwargs = {}
    if backend == "nccl":
        torch.cuda.set_device(rank)
        kwargs["device_id"] = torch.device("cuda", rank)
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=TIMEOUT_S), **kwargs)
    return Collective(rank, world, backend)


def shutdown() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
