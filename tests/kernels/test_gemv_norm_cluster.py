"""The fused norm shared by a thread-block cluster (cuda_quant.set_norm_cluster, csrc/quant/exl2_gemv_norm.cuh
gv_norm_rows_cluster): the cluster's blocks split the rows' reads by rms_norm_kernel's warps and exchange warp sums
and normalized rows through distributed shared memory.

Exact: every warp sum is the reference warp's own (same threads, vectors, fma chain), the row's sum is the
reference's final warp sum, so the GEMV input, output and residual stream are bit-identical to add_rms_norm followed
by the plain GEMV. Shapes: every bit width in a mixed layout, clusters of 2, 4 and 8, hidden sizes with 1, 4 and 8
reference warps per row (576, 4096, 8192), M from 1 to one cluster pass (grids that are and are not whole clusters:
the padding blocks only normalize), three parts with bias, the fused rope and KV write, a CUDA graph, the model
forward, routing and bad settings.
"""

from __future__ import annotations

import pytest
import torch

from exl2_backend.errors import ConfigError
from tests.kernels.test_exl2_dequant import _to_cuda, make_qt
from tests.kernels.test_gemv_norm import _check, _layout
from tests.kernels.tma_gemv import needs_tma_gemv, rand_half


@pytest.fixture
def norm_cluster():
    """set(C) for the test; the library goes back to its default after it."""
    from exl2_backend.ops import cuda_quant

    needs_tma_gemv("the cluster-shared fused norm")
    before = cuda_quant.norm_cluster()
    yield cuda_quant.set_norm_cluster
    cuda_quant.set_norm_cluster(before)


def test_norm_cluster_rows_is_one_pass_of_every_block_warp():
    """CPU: M * (reference warps per row) <= C * 8 compute warps, at most two token tiles; 0 when off."""
    from exl2_backend.ops.cuda_quant import norm_cluster_rows

    assert [norm_cluster_rows(4096, c) for c in (0, 2, 4, 8)] == [0, 4, 8, 16]
    assert norm_cluster_rows(576, 4) == 16 and norm_cluster_rows(8192, 4) == 4 and norm_cluster_rows(2048, 2) == 8


CLUSTER_CASES = [(2, 576, 1), (2, 576, 16), (4, 576, 7), (8, 576, 16), (2, 4096, 1), (2, 4096, 3), (4, 4096, 1),
                 (4, 4096, 2), (4, 4096, 5), (8, 4096, 5), (4, 8192, 2), (8, 8192, 2), (8, 1056, 11)]


@pytest.mark.cuda
@pytest.mark.parametrize("bits", [2, 3, 4, 5, 6, 8])
@pytest.mark.parametrize("c,k,m", CLUSTER_CASES)
def test_cluster_norm_equals_add_rms_norm_then_gemv(norm_cluster, bits, c, k, m):
    from exl2_backend.ops import cuda_quant

    norm_cluster(c)
    assert m <= cuda_quant.norm_cluster_rows(k, c)
    qt = _to_cuda(make_qt(_layout(k, bits), 333 + 64 * c, seed=bits * 7 + m, bias=bits == 5))
    op = cuda_quant.prepare_linear([qt], "cuda")
    w = rand_half((k,), seed=k + c, scale=0.3) + 1
    h, residual = rand_half((m, k), seed=m), rand_half((m, k), seed=m + 40, scale=4.0)
    _check(op, h, residual, w)
    _check(op, h, None, w)


@pytest.mark.cuda
@pytest.mark.parametrize("c", [2, 4])
def test_cluster_norm_three_parts_and_strided_rows(norm_cluster, c):
    from exl2_backend.ops import cuda_quant

    norm_cluster(c)
    k = 1056
    parts = [_to_cuda(make_qt(_layout(k, b), n, seed=b, bias=b == 3, key=f"p{b}")) for b, n in ((4, 576), (3, 192),
                                                                                                 (6, 200))]
    op = cuda_quant.prepare_linear(parts, "cuda")
    w = rand_half((k,), seed=1, scale=0.3) + 1
    h = rand_half((4, 2 * k), seed=2)[:, :k]  # row stride 2K
    _check(op, h, rand_half((4, k), seed=3), w)


@pytest.mark.cuda
@pytest.mark.parametrize("m", [1, 2, 5])
def test_cluster_norm_with_the_fused_rope_kv(norm_cluster, m):
    from tests.kernels.test_gemv_rope_kv import _both, _qkv, _step

    norm_cluster(4)
    hq, hk, d, k = 8, 2, 128, 1024
    op = _qkv(k, hq, hk, d, "8:0.05@32 6:0.1@32 5:0.2@64 4:0.3@128 3:0.2@128 2:0.15@128", seed=m)
    h, r, w = rand_half((m, k), m), rand_half((m, k), m + 1), rand_half((k,), 3, 0.2) + 1
    got, want = _both(op, h, r, w, hq, hk, d, _step(m, hk, d, seed=m))
    for a, b in zip(got, want):
        assert torch.equal(a, b)


@pytest.mark.cuda
def test_cluster_norm_in_a_cuda_graph(norm_cluster):
    """Captured with the cluster norm on, replayed on new inputs (and after the setting is switched off: the
    graph keeps its launches)."""
    from exl2_backend import ops
    from exl2_backend.ops import cuda_quant

    norm_cluster(4)
    k, m = 4096, 5
    op = cuda_quant.prepare_linear([_to_cuda(make_qt(_layout(k, 4), 1024, seed=4))], "cuda")
    w = rand_half((k,), seed=1, scale=0.3) + 1
    h, r = rand_half((m, k), seed=2), rand_half((m, k), seed=3)
    op.add_normed(h, r, w, 1e-5, always=True)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y, res = op.add_normed(h, r, w, 1e-5, always=True)
    norm_cluster(0)
    for seed in (11, 12):
        h.copy_(rand_half((m, k), seed))
        graph.replay()
        torch.cuda.synchronize()
        x, want_res = ops.add_rms_norm(h.clone(), r.clone(), w, 1e-5)
        assert torch.equal(y, op.fused_kernel(x.contiguous(), "gemv")) and torch.equal(res, want_res)


@pytest.mark.cuda
def test_cluster_norm_routing_and_settings(norm_cluster):
    """Routing fuses the norm for the rows one cluster pass takes (within the shared-memory cap: K = 4096, M <= 5);
    the library refuses a cluster it does not build."""
    from exl2_backend.ops import cuda_quant

    op = cuda_quant.prepare_linear([_to_cuda(make_qt(_layout(4096, 4), 64, seed=9))], "cuda")
    norm_cluster(0)
    assert [op.launch.takes_norm(m) for m in (1, 2, 3, 5)] == [True, True, False, False]
    norm_cluster(4)
    assert [op.launch.takes_norm(m) for m in (1, 3, 5, 6)] == [True, True, True, False]
    norm_cluster(2)
    assert [op.launch.takes_norm(m) for m in (4, 5)] == [True, False]  # 2 x 8 warps: 4 rows of 4 reference warps
    for bad in (1, 9, -1):
        with pytest.raises(ConfigError, match="norm cluster"):
            cuda_quant.set_norm_cluster(bad)
    assert cuda_quant.norm_cluster() == 2  # a refused setting changes nothing


@pytest.mark.cuda
@pytest.mark.parametrize("c", [2, 4])
def test_model_forward_bit_identical_with_the_cluster_norm(tmp_path, monkeypatch, norm_cluster, c):
    """LlamaModel: a 5-token prefill, then decode steps of 1 and 3 sequences; logits equal bit for bit with the
    cluster norm and with the norms as their own ops (layers.FUSED_NORM off)."""
    from exl2_backend.model import layers
    from exl2_backend.model.llama import LlamaModel
    from tests.helpers.forward_steps import prefill_then_decode
    from tests.helpers.synth import tiny_config_dict, write_tiny_exl2_model

    cfg = tiny_config_dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2)
    model = LlamaModel.from_dir(write_tiny_exl2_model(tmp_path / "m", cfg, seed=3), "cuda")
    norm_cluster(c)
    assert model.layers[0].qkv.launch.takes_norm(5)

    def run(on: bool) -> list[torch.Tensor]:
        monkeypatch.setattr(layers, "FUSED_NORM", on)
        return prefill_then_decode(model)

    for a, b in zip(run(True), run(False)):
        assert torch.equal(a, b)
