"""The TMA GEMV's split-K sum is the same for a row whatever the rows beside it (csrc/quant/exl2_gemv.cuh).

The last block of a column block sums its M x 64 column quads (gv_reduce_partials_vec4): at M <= 4 one quad per
thread, at M = 5 or 6 (a k = 4 verify step) some threads take two. Every column is summed in split order from zero
either way, so every row of an M = 5, 6 or 8 launch must equal, bit for bit, the same row launched alone, where the
plan gives both the same splits: the speculative verify step's exactness rests on it, and any other walk of the sum
must keep it (session 53's gv_reduce_partials_flat at 6e00f87 did, and lost on time: H100 call BR1, session 54).
Shapes: the 8B's o (16 column blocks), q/k/v (24), a wide projection (few splits), the gated down; a partial last
column block; with bias.
"""

from __future__ import annotations

import pytest
import torch

from tests.kernels.test_exl2_dequant import _to_cuda, make_qt
from tests.kernels.test_gemv_norm import _layout
from tests.kernels.tma_gemv import needs_tma_gemv, rand_half

pytestmark = pytest.mark.cuda


def _rows_alone_equal(op, x: torch.Tensor, gated: bool = False) -> None:
    launch = op.launch
    m = x.shape[0]
    if launch.gemv_splits(m) != launch.gemv_splits(1):
        pytest.skip(f"this card's plan splits M = {m} and M = 1 differently")

    def run(rows: torch.Tensor) -> torch.Tensor:
        return op.gated(rows) if gated else op.fused_kernel(rows, "gemv")

    together = run(x)
    for i in range(m):
        assert torch.equal(together[i : i + 1], run(x[i : i + 1].contiguous())), f"row {i} of {m}"


# (K, N, bits, bias): o-like 4096 x 4096 (16 column blocks), q/k/v-like N = 6144, a wide N = 14336 (few splits), a
# partial last column block (N = 4000) with bias.
SHAPES = [(4096, 4096, 4, False), (4096, 6144, 5, False), (4096, 14336, 3, False), (4096, 4000, 6, True)]


@pytest.mark.parametrize("m", [5, 6, 8])
@pytest.mark.parametrize("k,n,bits,bias", SHAPES)
def test_rows_of_a_wide_launch_equal_the_rows_alone(k, n, bits, bias, m):
    from exl2_backend.ops import cuda_quant

    needs_tma_gemv("the split-K sum")
    op = cuda_quant.prepare_linear([_to_cuda(make_qt(_layout(k, bits), n, seed=k + n + bits, bias=bias))], "cuda")
    _rows_alone_equal(op, rand_half((m, k), seed=m + n))


@pytest.mark.parametrize("m", [5, 6])
def test_gated_down_rows_equal_the_rows_alone(m):
    """The 8B's down shape (K = 14336 from silu(gate) * up, N = 4096): 16 column blocks."""
    from exl2_backend.ops import cuda_quant

    needs_tma_gemv("the split-K sum")
    op = cuda_quant.prepare_linear([_to_cuda(make_qt(_layout(14336, 4), 4096, seed=7))], "cuda")
    _rows_alone_equal(op, rand_half((m, 2 * 14336), seed=m, scale=2.0), gated=True)
