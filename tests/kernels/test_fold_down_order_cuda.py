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
    assert op.launch.gathers_gated(gate_up, k) and not op.launch.pregathers(m, gate_up, k)  # the vector gather
    assert torch.equal(op.gated(gate_up), want)


@pytest.mark.parametrize("m", [1, 5, 12])
def test_gated_inputs_the_vector_gather_cannot_read_are_pre_gathered(m):
    """The gated GEMV's input off the 16-byte grid (a view 4 halves into its buffer) and a down in the file's
    act-order permutation (no runs of 8) take the pre-gathering launch instead: the same bits as silu_mul then the
    GEMV. A raw launch that would need the vector gather there is refused with a typed error."""
    from exl2_backend import ops
    from exl2_backend.errors import KernelUnavailableError

    lw = _layer(5)
    g = torch.Generator(device="cuda").manual_seed(m)
    for down_qt in (fold_down_order(lw).down_proj, lw.down_proj):
        op = cuda_quant.prepare_linear([_to_cuda(down_qt)], "cuda")
        k = op.in_features
        buf = (torch.randn(m * 2 * k + 4, generator=g, device="cuda") * 2).half()
        for gate_up in (buf[: m * 2 * k].view(m, 2 * k), buf[4:].view(m, 2 * k)):
            aligned = gate_up.data_ptr() % 16 == 0
            assert op.launch.gathers_gated(gate_up, k) == (aligned and op.launch.input_in_order)
            want = op.fused_kernel(ops.silu_mul(gate_up[:, :k], gate_up[:, k:]).contiguous(), "gemv")
            assert torch.equal(op.gated(gate_up), want)
    launch = op.launch  # the permuted down: every launch of its gated input must be pre-gathered
    ws, counters = op.workspace.buffers()
    _, blob = launch._bind(launch.gemv_plan(m), m, ws, counters, gate_up.device)
    aligned = buf[: m * 2 * k].view(m, 2 * k)
    with pytest.raises(KernelUnavailableError, match="aligned runs of 8"):
        launch._launch_gemv(blob, aligned, m, k, None, 0, cuda_quant._stream(aligned.device))
