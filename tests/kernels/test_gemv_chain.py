"""The persistent GEMV chain (csrc/quant/exl2_gemv_chain.cu, ops/cuda_chain.py) against the launches it replaces.

Exact: every phase is the GEMV it replaces, planned the same way (splits, split-K order), and a norm phase repeats
add_rms_norm's arithmetic, so o -> gate/up (norm fused, or a norm phase) -> down (silu_mul fused, pre-gathered
where the one-by-one path pre-gathers) [-> next q/k/v] in one launch must equal the launches one by one bit for
bit, outputs and residual stream. Shapes: SmolLM2's (hidden 576: partial column blocks, up to 8 rows), a 2048/8192 layer
with the grid capped below its work items (blocks loop over several), the 8B layer at M = 1, 2 (norm fused), 5 and 8
(norm phases); norm phases forced on every shape;
every bit width; three and four phases; CUDA-graph replays (the grid barrier's words are reused); the routing's
refusals and the op's typed errors; the model forward with the chain on and off.
"""

from __future__ import annotations

import functools

import pytest
import torch

from exl2_backend.errors import TensorShapeError
from tests.kernels.test_exl2_dequant import _to_cuda, make_qt
from tests.kernels.tma_gemv import needs_tma_gemv, rand_half

pytestmark = pytest.mark.cuda

EPS = 1e-5


@pytest.fixture(autouse=True)
def _chain_on(monkeypatch):
    """The chain is opt-in (cuda_chain.GEMV_CHAIN); these tests run it. Its items stay inside one width run, so the
    launches it is compared with bit for bit use per-run splits too (span splits sum other partials)."""
    from exl2_backend.ops import cuda_chain, cuda_quant

    monkeypatch.setattr(cuda_chain, "GEMV_CHAIN", True)
    monkeypatch.setattr(cuda_quant, "GEMV_SPLITS", "balanced")


def _groups(k: int, bits, seed: int) -> list[tuple[int, int]]:
    """K rows in groups of 128 (a last partial one), widths cycling through `bits` (one width or a mix)."""
    widths = bits if isinstance(bits, (list, tuple)) else [bits]
    out, row, i = [], 0, seed
    while row < k:
        rows = min(128, k - row)
        out.append((widths[i % len(widths)], rows))
        row, i = row + rows, i + 1
    return sorted(out, key=lambda g: -g[0])  # stored order: widest runs first


def _linear(parts, seed: int):
    """A prepared CUDA linear of parts [(K, N, bits)] (several parts: one fused launch, like q/k/v or gate/up).
    Group scales sized so that weights have a standard deviation of about 1/sqrt(K) at every width: outputs stay
    O(1) through the layer (random 8-bit codes at make_qt's default scales overflow fp16 in the MLP)."""
    from exl2_backend.ops import cuda_quant

    qts = []
    for i, (k, n, bits) in enumerate(parts):
        groups = _groups(k, bits, seed + i)
        scale_max = [2.0 / (2 ** (b - 1) * k**0.5) for b, _ in groups]
        qts.append(_to_cuda(make_qt(groups, n, seed=seed * 7 + i, key=f"p{seed}_{i}", scale_max=scale_max)))
    return cuda_quant.prepare_linear(qts, "cuda")


@functools.lru_cache(maxsize=4)  # the 8B layer takes seconds to pack: shared by its parametrizations
def _layer(hidden: int, inter: int, heads_dim: int, kv_dim: int, bits, seed: int):
    o = _linear([(heads_dim, hidden, bits)], seed)
    gate_up = _linear([(hidden, inter, bits), (hidden, inter, bits)], seed + 10)
    down = _linear([(inter, hidden, bits)], seed + 20)
    qkv = _linear([(hidden, heads_dim, bits), (hidden, kv_dim, bits), (hidden, kv_dim, bits)], seed + 30)
    return o, gate_up, down, qkv


def _llama3_8b_layer():
    """The 8B layer (4096 / 14336, q/k/v 4096 + 1024 + 1024) at 4 bits with 8-bit groups mixed in (cached)."""
    return _layer(4096, 14336, 4096, 1024, (4, 4, 4, 8), seed=21)


def _layer_inputs(o, m: int, seed: int):
    """(x [m, o.in_features], residual [m, hidden], post-attention norm weight [hidden], next layer's input norm
    weight [hidden]) for the layer whose o_proj is `o`, from the four seeds seed .. seed + 3."""
    hidden = o.out_features
    return (rand_half((m, o.in_features), seed), rand_half((m, hidden), seed + 1, 4.0),
            rand_half((hidden,), seed + 2, 0.3) + 1, rand_half((hidden,), seed + 3, 0.3) + 1)


def _one_by_one(o, gate_up, down, nxt, x, residual, post_w, next_w):
    """The launches the chain replaces, as the model routes them without it (each norm fused into its GEMV where
    that takes one pass, else add_rms_norm first)."""
    from exl2_backend.model.layers import norm_linear

    h = o.fused_kernel(x, "gemv")
    gu, r1 = norm_linear(gate_up, h, residual, post_w, EPS)
    d = down.gated(gu)
    if nxt is None:
        return d, r1
    return norm_linear(nxt, d, r1, next_w, EPS)


def _check(o, gate_up, down, nxt, m: int, seed: int):
    from exl2_backend.ops import cuda_chain

    assert cuda_chain.chain_takes(o, gate_up, down, nxt, m)
    x, residual, post_w, next_w = _layer_inputs(o, m, seed)
    nw = None if nxt is None else next_w
    x0, r0 = x.clone(), residual.clone()
    want = _one_by_one(o, gate_up, down, nxt, x, residual, post_w, nw)
    assert torch.isfinite(want[0]).all(), "test data overflowed fp16"
    got = cuda_chain.mlp_chain(o, gate_up, down, nxt, x, residual, post_w, nw, EPS)
    assert got is not None
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert torch.equal(x, x0) and torch.equal(residual, r0)  # inputs untouched
    return got


@pytest.mark.parametrize("bits", [2, 3, 4, 5, 6, 8, (8, 4), (6, 5, 3)])
@pytest.mark.parametrize("m", [1, 3, 8])
def test_chain_equals_launches_smollm2_shape(bits, m):
    """Hidden 576 (3 column blocks of 256, the last with two warp tiles), intermediate 1536, 9 x 64 heads."""
    needs_tma_gemv("the GEMV chain")
    o, gate_up, down, qkv = _layer(576, 1536, 576, 192, bits, seed=m + 3 * len(str(bits)))
    _check(o, gate_up, down, qkv, m, seed=m)
    _check(o, gate_up, down, None, m, seed=m + 100)


@pytest.mark.parametrize("grid", [1, 7, 100])
@pytest.mark.parametrize("m", [1, 4, 6])
def test_chain_blocks_loop_over_work_items(grid, m, monkeypatch):
    """A 2048 / 8192 layer with three widths, the grid capped below the phases' work items: each block takes
    several items of a phase in turn (its ring re-planned between them; one block runs the whole chain alone)."""
    from exl2_backend.ops import cuda_chain

    needs_tma_gemv("the GEMV chain")
    monkeypatch.setattr(cuda_chain, "MAX_GRID", grid)
    monkeypatch.setattr(cuda_chain, "NORM_PHASES", "auto")  # M = 6: norm phases
    o, gate_up, down, qkv = _layer(2048, 8192, 2048, 512, (8, 5, 4), seed=11)
    _check(o, gate_up, down, qkv, m, seed=m + 7 * grid)


@pytest.mark.parametrize("m", [1, 2, 5, 8])
def test_chain_llama3_8b_layer(m, monkeypatch):
    """The 8B layer (4096 / 14336, q/k/v 4096 + 1024 + 1024) at 4 bits with 8-bit groups mixed in; norm phases from
    M = 3. (M = 5 was xfail from H200 call M3, "off by ~0.5%", to session 38: the launches it is compared with
    released their ring slots too early, test_gemv_repeat_identical.py; it passed in all ten runs since the fix.)"""
    from exl2_backend.ops import cuda_chain

    needs_tma_gemv("the GEMV chain")
    monkeypatch.setattr(cuda_chain, "NORM_PHASES", "auto")
    o, gate_up, down, qkv = _llama3_8b_layer()
    _check(o, gate_up, down, qkv, m, seed=m + 30)


@pytest.mark.parametrize("bits", [3, 5, 8, (6, 4)])
@pytest.mark.parametrize("m", [1, 2, 7])
def test_chain_norm_phases_forced(bits, m, monkeypatch):
    """Norm phases (block m normalizes row m, writes the residual stream and the stored-order input of the GEMV
    after it) on shapes where the fused norm would run: the same bits as add_rms_norm and the GEMV."""
    from exl2_backend.ops import cuda_chain

    needs_tma_gemv("the GEMV chain")
    monkeypatch.setattr(cuda_chain, "NORM_PHASES", "always")
    o, gate_up, down, qkv = _layer(576, 1536, 576, 192, bits, seed=40 + m)
    _check(o, gate_up, down, qkv, m, seed=m + 60)
    _check(o, gate_up, down, None, m, seed=m + 61)


def test_chain_pregather_phases(monkeypatch):
    """Every GEMV input pre-gathered (GEMV_PREGATHER_ITEMS = 1): pregather phases before o and down."""
    from exl2_backend.ops import cuda_quant

    needs_tma_gemv("the GEMV chain")
    monkeypatch.setattr(cuda_quant, "GEMV_PREGATHER_ITEMS", 1)
    o, gate_up, down, qkv = _layer(576, 1536, 576, 192, (8, 4), seed=3)
    assert o.launch.pregathers(3) and down.launch.pregathers(3)
    _check(o, gate_up, down, qkv, 3, seed=9)


def test_chain_replays_in_a_cuda_graph():
    """Captured once, replayed three times on new inputs: the same bits as eager launches each time (the grid
    barrier's two words come back to their start state, the split-K tickets too)."""
    from exl2_backend.ops import cuda_chain

    needs_tma_gemv("the GEMV chain")
    o, gate_up, down, qkv = _layer(576, 1536, 576, 192, (6, 4), seed=5)
    x, residual = rand_half((2, 576), 1), rand_half((2, 576), 2)
    post_w, next_w = rand_half((576,), 3) + 1, rand_half((576,), 4) + 1
    cuda_chain.mlp_chain(o, gate_up, down, qkv, x, residual, post_w, next_w, EPS)  # warm-up outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y, r = cuda_chain.mlp_chain(o, gate_up, down, qkv, x, residual, post_w, next_w, EPS)
    for i in range(3):
        x.copy_(rand_half((2, 576), 10 + i))
        residual.copy_(rand_half((2, 576), 20 + i))
        graph.replay()
        want = _one_by_one(o, gate_up, down, qkv, x, residual, post_w, next_w)
        assert torch.equal(y, want[0]) and torch.equal(r, want[1])
    ws = o.workspace
    assert ws.chain_barrier[0].item() == 0  # arrivals re-armed


def test_chain_routing_refusals(monkeypatch):
    from exl2_backend.ops import cuda_chain

    needs_tma_gemv("the GEMV chain")
    o, gate_up, down, qkv = _layer(576, 1536, 576, 192, 4, seed=9)
    x, r = rand_half((9, 576), 1), rand_half((9, 576), 2)
    w = rand_half((576,), 3) + 1
    assert cuda_chain.mlp_chain(o, gate_up, down, qkv, x, r, w, w, EPS) is None  # 9 rows: one token tile only
    assert cuda_chain.mlp_chain(o, gate_up, down, qkv, x[:2], r[:2], w, None, EPS) is None  # next without weight
    assert not cuda_chain.chain_takes(o, down, gate_up, qkv, 1)  # shapes do not chain
    big = _layer(4096, 512, 4096, 1024, 4, seed=2)
    assert cuda_chain.chain_takes(*big, 2) and not cuda_chain.chain_takes(*big, 3)  # norm phases are opt-in
    monkeypatch.setattr(cuda_chain, "NORM_PHASES", "auto")
    assert cuda_chain.chain_takes(*big, 8)  # norm phases from M = 3
    monkeypatch.setattr(cuda_chain, "GEMV_CHAIN", False)
    assert cuda_chain.mlp_chain(o, gate_up, down, qkv, x[:2], r[:2], w, w, EPS) is None


def test_chain_op_typed_errors():
    needs_tma_gemv("the GEMV chain")
    o, gate_up, down, qkv = _layer(576, 1536, 576, 192, 4, seed=9)
    ws, counters = o.workspace.buffers()
    bar = o.workspace.chain_barrier
    handles = [o.launch.handle, gate_up.launch.handle, down.launch.handle, qkv.launch.handle]
    packed = o.launch.parts[0].packed
    w = rand_half((576,), 3) + 1
    op = torch.ops.exl2_backend.exl2_gemv_chain
    with pytest.raises(TensorShapeError):  # 9 rows
        op(rand_half((9, 576), 1), rand_half((9, 576), 2), w, w, packed, handles, EPS, ws, counters, bar)
    with pytest.raises(TensorShapeError):  # residual of the wrong width
        op(rand_half((1, 576), 1), rand_half((1, 512), 2), w, w, packed, handles, EPS, ws, counters, bar)
    with pytest.raises(TensorShapeError):  # four handles, no next weight
        op(rand_half((1, 576), 1), rand_half((1, 576), 2), w, None, packed, handles, EPS, ws, counters, bar)
    with pytest.raises(TensorShapeError):  # a norm weight of the wrong length
        op(rand_half((1, 576), 1), rand_half((1, 576), 2), w[:-8], w, packed, handles, EPS, ws, counters, bar)


@pytest.mark.parametrize("norm_phases", ["auto", "always"])
def test_model_forward_bit_identical_with_and_without_the_chain(tmp_path, monkeypatch, norm_phases):
    """LlamaModel: a 5-token prefill (the chain runs it too: 5 rows), then decode steps of 1 and 3 sequences; logits
    equal bit for bit with the chain on and off, its norms fused or as phases."""
    from exl2_backend.model.llama import LlamaModel
    from exl2_backend.ops import cuda_chain
    from tests.helpers.forward_steps import prefill_then_decode
    from tests.helpers.synth import tiny_config_dict, write_tiny_exl2_model

    needs_tma_gemv("the GEMV chain")
    cfg = tiny_config_dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2)
    d = write_tiny_exl2_model(tmp_path / "m", cfg, seed=4)
    model = LlamaModel.from_dir(d, "cuda")
    layer, nxt = model.layers[0], model.layers[1]
    assert cuda_chain.chain_takes(layer.o, layer.gate_up, layer.down, nxt.qkv, 3)

    monkeypatch.setattr(cuda_chain, "NORM_PHASES", norm_phases)

    def run(on: bool) -> list[torch.Tensor]:
        monkeypatch.setattr(cuda_chain, "GEMV_CHAIN", on)
        return prefill_then_decode(model)

    for a, b in zip(run(True), run(False)):
        assert torch.equal(a, b)
