"""gate/up and down_proj as a flag pair (ops/cuda_mlp_pair.py, csrc/quant/exl2_gemv_flags.cuh).

Exact: the pair runs the same two GEMVs (same plans, same arithmetic) as gate/up's norm-fused GEMV followed by
down's gated GEMV; only where each down block starts differs (on ready flags instead of the PDL wait). So its
output and residual stream are bit-identical to the two ops one by one, at one and several token rows (the
norm inside gate/up's GEMV and the pre-gathering norm), at the 8B's MLP shape, back to back without a sync and as
a replayed CUDA graph; the flags are all zero after every pair. Shapes the pair does not take fall back.
"""

from __future__ import annotations

import functools

import pytest
import torch

from exl2_backend.errors import TensorShapeError
from exl2_backend.format.reader import LayerWeights
from exl2_backend.model.tp_shard import fold_down_order
from exl2_backend.ops import cuda_mlp_pair
from tests.helpers.synth import random_qtensor
from tests.kernels.test_exl2_dequant import _to_cuda

pytestmark = pytest.mark.cuda


def _needs_tma():
    from exl2_backend.ops import cuda_quant

    if cuda_quant.gemv_row_cap(torch.device("cuda")) < 32 or cuda_quant.GEMV_MINB != 0:
        pytest.skip("the flag pair runs on the TMA GEMV only (sm_90+)")


@functools.lru_cache(maxsize=4)
def _mlp_ops(h: int, i: int, seed: int, fold: bool = True):
    """(gate_up, down) CUDA ops of a random MLP of hidden h and intermediate i in mixed widths, down's order folded
    into gate/up as the model loads it (cached: the 8B's takes seconds to build)."""
    from exl2_backend.ops import cuda_quant

    def qt(key, k, n, option, s):
        return random_qtensor(key, k, n, option, seed=seed * 10 + s)

    norm = torch.ones(h, dtype=torch.float16)
    lw = LayerWeights(input_layernorm=norm, post_attention_layernorm=norm, q_proj=None, k_proj=None, v_proj=None,
                      o_proj=None, gate_proj=qt("gate", h, i, "6:0.3@32 4:0.7@64", 5),
                      up_proj=qt("up", h, i, "5:0.5@32 3:0.5@32", 6), down_proj=qt("down", i, h, "8:0.1@32 4:0.9@64", 7))
    if fold:
        lw = fold_down_order(lw)
    gate_up = cuda_quant.prepare_linear([_to_cuda(lw.gate_proj), _to_cuda(lw.up_proj)], "cuda")
    down = cuda_quant.prepare_linear([_to_cuda(lw.down_proj)], "cuda")
    return gate_up, down


def _inputs(m: int, h: int, seed: int):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = (torch.randn(m, h, generator=g, device="cuda") * 0.5).half()
    residual = (torch.randn(m, h, generator=g, device="cuda") * 2).half()
    w = (torch.rand(h, generator=g, device="cuda") * 0.5 + 0.75).half()
    return x, residual, w


def _one_by_one(gate_up, down, x, residual, w):
    gu, res = gate_up.add_normed(x, residual, w, 1e-5)
    return down.gated(gu), res


def _flags_clear(gate_up) -> bool:
    torch.cuda.synchronize()
    return not gate_up.workspace.flags.any().item()


# (hidden, intermediate): 5 + 5 column blocks of gate/up (odd counts), and the 8B's MLP (56 + 56)
SHAPES = [(1024, 1280), (4096, 14336)]


@pytest.mark.parametrize("m", [1, 2, 3, 5, 8])
@pytest.mark.parametrize("h,i", SHAPES)
def test_pair_equals_gate_up_then_down(monkeypatch, h, i, m):
    _needs_tma()
    monkeypatch.setattr(cuda_mlp_pair, "MLP_FLAGS", True)
    gate_up, down = _mlp_ops(h, i, seed=1)
    assert cuda_mlp_pair.pair_takes(gate_up, down, m)
    x, residual, w = _inputs(m, h, seed=m)
    want, want_res = _one_by_one(gate_up, down, x, residual, w)
    for _ in range(3):  # back to back: each pair's consumer clears the flags for the next
        got = cuda_mlp_pair.mlp_pair(gate_up, down, x, residual, w, 1e-5)
        assert got is not None
        assert torch.equal(got[0], want) and torch.equal(got[1], want_res)
    assert _flags_clear(gate_up)


def test_pair_in_a_cuda_graph(monkeypatch):
    """Captured once, replayed: every replay equals the ops one by one, for new inputs copied in as well."""
    _needs_tma()
    monkeypatch.setattr(cuda_mlp_pair, "MLP_FLAGS", True)
    h, i, m = 1024, 1280, 1
    gate_up, down = _mlp_ops(h, i, seed=7)
    x, residual, w = _inputs(m, h, seed=7)
    cuda_mlp_pair.mlp_pair(gate_up, down, x, residual, w, 1e-5)  # warm-up: reserves the workspace
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, res = cuda_mlp_pair.mlp_pair(gate_up, down, x, residual, w, 1e-5)
    for seed in (7, 8, 9):
        nx, nr, _ = _inputs(m, h, seed=seed)
        x.copy_(nx)
        residual.copy_(nr)
        for _ in range(2):
            graph.replay()
        want, want_res = _one_by_one(gate_up, down, x, residual, w)
        assert torch.equal(out, want) and torch.equal(res, want_res)
    assert _flags_clear(gate_up)


def test_pair_declines_what_it_cannot_take(monkeypatch):
    """Off by the switch, nine rows, gate/up columns off the 256-column grid: None (the caller runs the two ops)."""
    _needs_tma()
    gate_up, down = _mlp_ops(1024, 1280, seed=3)
    x, residual, w = _inputs(1, 1024, seed=3)
    monkeypatch.setattr(cuda_mlp_pair, "MLP_FLAGS", False)
    assert cuda_mlp_pair.mlp_pair(gate_up, down, x, residual, w, 1e-5) is None
    monkeypatch.setattr(cuda_mlp_pair, "MLP_FLAGS", True)
    x9, r9, _ = _inputs(9, 1024, seed=3)
    assert cuda_mlp_pair.mlp_pair(gate_up, down, x9, r9, w, 1e-5) is None
    odd_gu, odd_down = _mlp_ops(1024, 1056, seed=3)  # up starts at column 1056: not on a 256-column block
    assert not cuda_mlp_pair.pair_takes(odd_gu, odd_down, 1)
    assert cuda_mlp_pair.mlp_pair(odd_gu, odd_down, x, residual, w, 1e-5) is None


def test_pair_op_rejects_bad_calls():
    _needs_tma()
    gate_up, down = _mlp_ops(1024, 1280, seed=4)
    x9, r9, w = _inputs(9, 1024, seed=4)
    ws, counters = gate_up.workspace.buffers()
    flags = gate_up.workspace.flags
    args = (gate_up.launch.parts[0].packed, gate_up.launch.handle, down.launch.parts[0].packed, down.launch.handle)
    with pytest.raises(TensorShapeError, match="rows"):
        torch.ops.exl2_backend.exl2_mlp_pair(x9, r9, w, 1e-5, *args, ws, counters, flags, True)
    x, r, _ = _inputs(1, 1024, seed=4)
    with pytest.raises(TensorShapeError, match="flags"):
        torch.ops.exl2_backend.exl2_mlp_pair(x, r, w, 1e-5, *args, ws, counters, flags[:4], False)
    assert _flags_clear(gate_up)


@pytest.mark.parametrize("fused_rows", [8, 2])
def test_model_forward_bit_identical_with_and_without_the_pair(tmp_path, monkeypatch, fused_rows):
    """LlamaModel: a 5-token prefill, then decode steps of 1 and 3 sequences; logits equal bit for bit with the
    flag pair on and off, and the pair ran in every layer of every step. fused_rows 2: steps of more rows run
    gate/up after the pre-gathering norm."""
    from exl2_backend.model.llama import LlamaModel
    from exl2_backend.ops import cuda_quant
    from tests.helpers.forward_steps import prefill_then_decode
    from tests.helpers.synth import tiny_config_dict, write_tiny_exl2_model

    _needs_tma()
    cfg = tiny_config_dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2)
    d = write_tiny_exl2_model(tmp_path / "m", cfg, seed=5)
    monkeypatch.setattr(cuda_quant, "NORM_SMEM_BYTES", fused_rows * 256 * 2)
    model = LlamaModel.from_dir(d, "cuda")
    ran = []
    real = cuda_mlp_pair.mlp_pair

    def counting(*a):
        out = real(*a)
        ran.append(out is not None)
        return out

    monkeypatch.setattr(cuda_mlp_pair, "mlp_pair", counting)

    def run(on: bool) -> list[torch.Tensor]:
        monkeypatch.setattr(cuda_mlp_pair, "MLP_FLAGS", on)
        return prefill_then_decode(model)

    with_pair = run(True)
    assert ran and all(ran)
    for a, b in zip(with_pair, run(False)):
        assert torch.equal(a, b)
    assert _flags_clear(model.layers[0].gate_up)
