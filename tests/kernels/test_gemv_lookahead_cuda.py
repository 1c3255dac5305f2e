"""The L2 lookahead on the GPU (csrc/quant/exl2_gemv_lookahead.cu, ops/cuda_lookahead.py): a GEMV whose producer
warps prefetch the next GEMV's first bytes into L2 computes the same bits as without, in every launch form (plain,
silu-gated, norm-fused, pre-gathering norm; 1..32 rows; eager and graph-replayed), whatever the budget (constants
only, part of the target, all of it). The model forward with every GEMV linked equals the unlinked one bit for bit.
"""

from __future__ import annotations

import pytest
import torch

from tests.kernels.test_exl2_dequant import _to_cuda

pytestmark = pytest.mark.cuda

BUDGETS = [16, 1 << 20, 1 << 40]  # rounds to no weights (constants only), part of the target, all of it


def _op(option: str, k: int, n: int, seed: int, parts: int = 1):
    from exl2_backend.ops import cuda_quant
    from tests.helpers.synth import random_qtensor

    return cuda_quant.prepare_linear([_to_cuda(random_qtensor(f"p{i}", k, n, option, seed=seed + i))
                                      for i in range(parts)], "cuda")


def _rand(shape, seed: int) -> torch.Tensor:
    g = torch.Generator(device="cuda").manual_seed(seed)
    return (torch.randn(*shape, generator=g, device="cuda") * 0.5).half()


def _with_and_without(op, target, budget, run):
    from exl2_backend.ops.cuda_lookahead import set_lookahead

    set_lookahead(op, None, 0)
    want = run()
    assert set_lookahead(op, target, budget)
    try:
        got = run()
    finally:
        set_lookahead(op, None, 0)
    return got, want


@pytest.mark.parametrize("budget", BUDGETS)
@pytest.mark.parametrize("m", [1, 2, 5, 9, 17, 32])
@pytest.mark.parametrize("option", ["4:1@128", "8:0.05@32 6:0.1@32 5:0.2@64 4:0.3@128 3:0.2@128 2:0.15@128"])
def test_gemv_with_lookahead_is_bit_identical(option, m, budget):
    op = _op(option, 4096, 1024, seed=m, parts=3)  # q/k/v-like: three parts in one launch
    target = _op("5:0.1@128 4:0.9@128", 1024, 4096, seed=100)
    x = _rand((m, 4096), m)
    got, want = _with_and_without(op, target, budget, lambda: op.fused_kernel(x, "gemv"))
    assert torch.equal(got, want)


@pytest.mark.parametrize("budget", BUDGETS)
@pytest.mark.parametrize("m", [1, 3, 8])
def test_gated_and_norm_fused_gemvs_with_lookahead_are_bit_identical(m, budget):
    from exl2_backend.ops import cuda_quant

    if cuda_quant.gemv_row_cap(torch.device("cuda")) < 32 or cuda_quant.GEMV_MINB != 0:
        pytest.skip("the norm-fused GEMV runs on the TMA kernel only (sm_90+)")
    down = _op("6:0.2@32 4:0.8@128", 2048, 1024, seed=m)
    up = _op("4:1@128", 1024, 2048, seed=7, parts=2)
    gate_up = _rand((m, 4096), m)
    got, want = _with_and_without(down, up, budget, lambda: down.gated(gate_up))
    assert torch.equal(got, want)
    h, r, w = _rand((m, 1024), 2 * m), _rand((m, 1024), 3 * m), _rand((1024,), 4) + 1
    for pregather in (False, True):
        got, want = _with_and_without(up, down, budget,
                                      lambda: up.add_normed(h, r, w, 1e-5, always=not pregather, pregather=pregather))
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_lookahead_in_a_cuda_graph_is_bit_identical():
    from exl2_backend.ops.cuda_lookahead import link_lookahead, set_lookahead

    ops_ = [_op("4:1@128", 2048, 2048, seed=i) for i in range(3)]
    x = _rand((1, 2048), 1)

    def chain():
        y = x
        for op in ops_:
            y = op.fused_kernel(y, "gemv")
        return y

    want = chain()
    assert link_lookahead(ops_ + [ops_[0]], 1 << 20) == 3
    try:
        chain()  # warm up outside the graph (workspace, plans)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = chain()
        for _ in range(3):
            graph.replay()
            torch.cuda.synchronize()
            assert torch.equal(out, want)
    finally:
        for op in ops_:
            set_lookahead(op, None, 0)


def test_model_forward_bit_identical_with_the_lookahead(tmp_path, monkeypatch):
    """LlamaModel: every layer's q/k/v -> o -> gate/up -> down -> next q/k/v, then the head and the first q/k/v
    linked; a prefill and decode steps of one and three sequences give the same logits as with no links."""
    from exl2_backend.model.llama import LlamaModel
    from exl2_backend.ops import cuda_lookahead
    from tests.helpers.forward_steps import prefill_then_decode
    from tests.helpers.synth import tiny_config_dict, write_tiny_exl2_model

    cfg = tiny_config_dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2,
                           tie_word_embeddings=False)
    d = write_tiny_exl2_model(tmp_path / "m", cfg, seed=3)
    monkeypatch.setattr(cuda_lookahead, "LOOKAHEAD_BYTES", 0)
    model = LlamaModel.from_dir(d, "cuda")
    assert model.layers[0].qkv.launch.lookahead is None
    want = prefill_then_decode(model)
    monkeypatch.setattr(cuda_lookahead, "LOOKAHEAD_BYTES", 1 << 20)
    layers = len(model.layers)
    assert model.link_lookahead() == 4 * layers + 1  # the head -> the first q/k/v closes the loop
    assert model.lm_head.launch.lookahead_target is model.layers[0].qkv.launch
    for a, b in zip(prefill_then_decode(model), want):
        assert torch.equal(a, b)
