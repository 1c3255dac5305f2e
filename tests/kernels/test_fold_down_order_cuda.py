"""The MLP with down_proj's row order folded into gate/up (model/tp_shard.fold_down_order) on the CUDA kernels:
bit-identical to the file's order, since every column and every stored row keeps its arithmetic; down's input is
then gathered coalesced (neighbouring rows, neighbouring features) and never pre-gathered."""

from __future__ import annotations

import pytest
import torch

from exl2_backend.model.tp_shard import fold_down_order
from exl2_backend.ops import cuda_quant
from tests.kernels.test_exl2_dequant import _to_cuda
from tests.unit.test_fold_down_order import H, _layer

pytestmark = pytest.mark.cuda


def _mlp_out(lw, x: torch.Tensor) -> tuple[torch.Tensor, object]:
    """x [M, H] fp16 -> (down(silu(gate) * up) [M, H], the down op)."""
    gate_up = cuda_quant.prepare_linear([_to_cuda(lw.gate_proj), _to_cuda(lw.up_proj)], "cuda")
    down = cuda_quant.prepare_linear([_to_cuda(lw.down_proj)], "cuda")
    return down.gated(gate_up(x)), down


@pytest.mark.parametrize("m", [1, 2, 5, 8, 17])
def test_folded_mlp_is_bit_identical_on_the_gpu(m):
    lw = _layer(4)
    x = (torch.randn(m, H, generator=torch.Generator(device="cuda").manual_seed(m), device="cuda") * 0.5).half()
    want, down = _mlp_out(lw, x)
    got, down_folded = _mlp_out(fold_down_order(lw), x)
    assert torch.equal(got, want)
    assert down_folded.launch.input_in_order and not down.launch.input_in_order
    assert not down_folded.launch.pregathers(m)


@pytest.mark.parametrize("m", [1, 3, 5, 8, 9, 17, 32])
def test_in_order_gated_gemv_equals_silu_mul_then_gemv(m):
    """An input in stored order (identity invperm, run padding between widths: features resume 32 stored rows
    later): the gated GEMV equals silu_mul followed by the plain GEMV bit for bit, at one to four token tiles."""
    from exl2_backend import ops
    from exl2_backend.format.qtensor_slice import select_group_rows
    from tests.helpers.synth import random_qtensor

    k, n = 1056, 300  # one 6-bit group of 32 rows, padded to a 64-row chunk before the 4-bit run: the features
    full = random_qtensor("down", k, n, "6:0.03@32 4:0.97@64", seed=m)  # after it sit 32 stored rows later
    qt, _ = select_group_rows(full, 0, len(full.groups))
    op = cuda_quant.prepare_linear([_to_cuda(qt)], "cuda")
    assert op.launch.input_in_order and op.launch.parts[0].runs[1][1] == 1 and op.launch.parts[0].Kpad == k + 32
    g = torch.Generator(device="cuda").manual_seed(m)
    gate_up = (torch.randn(m, 2 * k, generator=g, device="cuda") * 2).half()
    want = op.fused_kernel(ops.silu_mul(gate_up[:, :k], gate_up[:, k:]).contiguous(), "gemv")
    assert torch.equal(op.gated(gate_up), want)
