"""model/tp_shard.fold_down_order: gate/up produce down_proj's input in its stored row order. The folded MLP's
weights are exact reorderings of the file's (bit for bit), down's rows end up in input order, and the MLP computes
the same function."""

from __future__ import annotations

import torch

from exl2_backend.format.reader import LayerWeights
from exl2_backend.model.tp_shard import fold_down_order
from exl2_backend.ops import reference
from tests.helpers.synth import random_qtensor
from tests.helpers.tolerances import assert_exact

H, I = 128, 320  # hidden, intermediate (I: groups of 32 and 64 in mixed widths, runs padded to 64-row chunks)


def _layer(seed: int) -> LayerWeights:
    def qt(key, k, n, option, s):
        return random_qtensor(key, k, n, option, seed=seed * 10 + s)

    norm = torch.ones(H, dtype=torch.float16)
    return LayerWeights(
        input_layernorm=norm, post_attention_layernorm=norm, q_proj=qt("q", H, H, "4:1@32", 1),
        k_proj=qt("k", H, 64, "4:1@32", 2), v_proj=qt("v", H, 64, "4:1@32", 3), o_proj=qt("o", H, H, "4:1@32", 4),
        gate_proj=qt("gate", H, I, "6:0.3@32 4:0.7@64", 5), up_proj=qt("up", H, I, "5:0.5@32 3:0.5@32", 6),
        down_proj=qt("down", I, H, "8:0.1@32 4:0.9@64", 7))


def _mlp(lw: LayerWeights, x: torch.Tensor) -> torch.Tensor:
    """The SwiGLU MLP on the reference ops in float64: x [T, H] -> [T, H]."""
    gate = x @ reference.exl2_dequant(lw.gate_proj)[:, : lw.gate_proj.out_features].double()
    up = x @ reference.exl2_dequant(lw.up_proj)[:, : lw.up_proj.out_features].double()
    return (torch.nn.functional.silu(gate) * up) @ reference.exl2_dequant(lw.down_proj)[:, :H].double()


def test_folded_weights_are_exact_reorderings_and_down_is_in_input_order():
    lw = _layer(1)
    folded = fold_down_order(lw)
    features = lw.down_proj.q_perm.long()  # stored row k of down holds original feature features[k]
    assert torch.equal(folded.down_proj.q_invperm, torch.arange(I, dtype=folded.down_proj.q_invperm.dtype))
    assert_exact(reference.exl2_dequant(folded.down_proj), reference.exl2_dequant(lw.down_proj)[features])
    for name in ("gate_proj", "up_proj"):
        old, new = getattr(lw, name), getattr(folded, name)
        assert new.out_features == I and torch.equal(new.q_invperm, old.q_invperm)  # inputs untouched
        assert_exact(reference.exl2_dequant(new)[:, :I], reference.exl2_dequant(old)[:, features])
    for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
        assert getattr(folded, name) is getattr(lw, name)


def test_folded_mlp_computes_the_same_function():
    lw = _layer(2)
    x = torch.randn(3, H, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(_mlp(fold_down_order(lw), x), _mlp(lw, x), rtol=1e-10, atol=1e-10)


def test_a_layer_already_in_order_is_returned_as_is():
    folded = fold_down_order(_layer(3))
    assert fold_down_order(folded) is folded


def test_qtensor_to_keeps_every_tensor_and_the_group_layout():
    qt = _layer(4).gate_proj
    same = qt.to("cpu")
    assert same is qt
    moved = qt.to("meta")
    assert moved.q_weight.device.type == "meta" and moved.q_invperm.device.type == "meta"
    assert moved.groups == qt.groups and moved.out_features == qt.out_features and moved.key == qt.key


def test_folded_down_takes_the_vector_gated_gather():
    """The TMA GEMV gathers a gated input by vectors (gv_gather_gated_runs), which needs the xmap in aligned
    runs of 8 features (F_VEC8): the folded down (input order, its width runs padded to whole chunks) has them, the
    file's act-order permutation does not, so that launch pre-gathers instead."""
    from exl2_backend.ops import cuda_quant

    cpu = torch.device("cpu")
    lw = _layer(2)
    folded = cuda_quant._Launch([cuda_quant.pack_qtensor(fold_down_order(lw).down_proj, cpu)], cpu)
    permuted = cuda_quant._Launch([cuda_quant.pack_qtensor(lw.down_proj, cpu)], cpu)
    assert folded.input_in_order and not permuted.input_in_order
    assert folded.gemv_plan(5).blob[0, cuda_quant.F_VEC8] == 1 and permuted.gemv_plan(5).blob[0, cuda_quant.F_VEC8] == 0
    gate_up = torch.zeros(5, 2 * I, dtype=torch.float16)
    assert folded.gathers_gated(gate_up, I) and not permuted.gathers_gated(gate_up, I)
    assert not folded.gathers_gated(gate_up[:, 4:], I - 4)  # gate_off and the start off the 16-byte grid


def test_xmap_runs_of_8():
    """xmap_in_runs_of_8 over kernel xmaps (int16, -1 = 0xFFFF padding): identity, padded runs, a shift by 4, a
    swap inside a vector, a run that ends mid-vector."""
    from exl2_backend.ops.cuda_quant import xmap_in_runs_of_8

    def xm(*parts):
        return torch.cat([torch.as_tensor(p, dtype=torch.int64) for p in parts]).to(torch.int16)

    pad = [-1] * 32
    assert xmap_in_runs_of_8(xm(range(64)))
    assert xmap_in_runs_of_8(xm(range(32), pad, range(32, 96), pad))
    assert not xmap_in_runs_of_8(xm(range(4, 68)))  # consecutive, but vectors start off a multiple of 8
    assert not xmap_in_runs_of_8(xm([1, 0], range(2, 64)))
    assert not xmap_in_runs_of_8(xm(range(36), [-1] * 28))  # the run ends inside a vector
    assert xmap_in_runs_of_8(xm(range(40000, 40064)))  # features past 32767 are negative as int16
