"""Shared by the TMA GEMV's GPU tests (plain, norm-fused, rope-fused, chained, repeated): the skip where that kernel
is not the small-M GEMV, and seeded fp16 inputs on the GPU."""

from __future__ import annotations

import pytest
import torch


def needs_tma_gemv(what: str) -> None:
    """Skips the calling test where the TMA GEMV does not run: before sm_90, or with GEMV_MINB routing small M to the
    older kernel. `what` names the tested feature in the skip message."""
    from exl2_backend.ops import cuda_quant

    if cuda_quant.gemv_row_cap(torch.device("cuda")) < 32 or cuda_quant.GEMV_MINB != 0:
        pytest.skip(f"{what} needs the TMA GEMV (sm_90+)")


def rand_half(shape, seed: int, scale: float = 1.0) -> torch.Tensor:
    """[*shape] fp16 on the GPU, normal times `scale`, from its own generator (the same values for the same seed)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    return (torch.randn(*shape, generator=g, device="cuda") * scale).half()
