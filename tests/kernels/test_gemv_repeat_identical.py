"""The TMA GEMV gives the same bits on every launch of the same inputs (csrc/quant/exl2_gemv_tma.cuh tma_chunks).

A compute warp released its ring slot right after issuing its shared loads; the producer's next bulk copy into the
slot (an async-proxy write) could then land before the loads read it, and that warp summed another chunk's weights:
on an H100 (BD20-BD22 of 2026-12-06) the 8B layer's gated down GEMV at M = 2 returned one or a few wrong warp tiles
(32 columns, both tokens, up to 1.2 off the fp32 reference) in 27% of identical launches, the norm-fused gate/up in
0.2-1%; every other test compared with a tolerance or ran once. The release now follows a proxy fence. Here each
launch is repeated on fixed inputs and every result must equal the first bit for bit (hundreds of repeats: the gated
down failed in ~1 of 4 before the fix, the fused gate/up in ~1 of 300), and the first must be near the reference.
"""

from __future__ import annotations

import pytest
import torch

from tests.kernels.tma_gemv import needs_tma_gemv, rand_half

pytestmark = pytest.mark.cuda


def _same_every_time(fn, repeats: int) -> torch.Tensor:
    first = fn().clone()
    differ = sum(not torch.equal(fn(), first) for _ in range(repeats))  # bounded
    assert differ == 0, f"{differ} of {repeats} identical launches gave other bits"
    return first


@pytest.mark.parametrize("splits", ["span", "balanced"])
@pytest.mark.parametrize("m", [1, 2, 5])
def test_gated_down_projection_repeats_bit_identical(m, splits, monkeypatch):
    """down(silu(gate) * up), K = 14336 in an 8-bit and a 4-bit run: M = 2 gathers in the kernel (the case that
    failed), M = 5 copies a pre-gathered input. The first result within fp16 noise of the fp32 reference."""
    from exl2_backend.ops import cuda_quant
    from tests.kernels import test_gemv_chain as t

    needs_tma_gemv("the repeat check")
    monkeypatch.setattr(cuda_quant, "GEMV_SPLITS", splits)
    _, _, down, _ = t._llama3_8b_layer()  # cached across tests
    gate_up = rand_half((m, 2 * 14336), 40 + m, 2.0)  # [M, gate | up]
    got = _same_every_time(lambda: down.gated(gate_up), 400)
    gate, up = gate_up[:, :14336].float(), gate_up[:, 14336:].float()
    want = (torch.nn.functional.silu(gate) * up) @ down.launch.dequant(0, 0, down.out_features).float()
    assert (got.float() - want).abs().max() < 0.02 * want.abs().max()


@pytest.mark.parametrize("m", [1, 2])
def test_norm_fused_gate_up_repeats_bit_identical(m, monkeypatch):
    """rms_norm(h + residual) fused into the gate/up GEMV (two parts of 14336 columns), span splits (the default)."""
    from exl2_backend.model.layers import norm_linear
    from exl2_backend.ops import cuda_quant
    from tests.kernels import test_gemv_chain as t

    needs_tma_gemv("the repeat check")
    monkeypatch.setattr(cuda_quant, "GEMV_SPLITS", "span")
    _, gate_up, _, _ = t._llama3_8b_layer()
    h, residual = rand_half((m, 4096), 50 + m), rand_half((m, 4096), 60 + m, 4.0)
    weight = rand_half((4096,), 70, 0.3) + 1
    _same_every_time(lambda: norm_linear(gate_up, h, residual, weight, t.EPS)[0], 1500)
