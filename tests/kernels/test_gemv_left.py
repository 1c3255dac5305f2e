"""gate/up's split-K partials left to down's gather (ops/cuda_left.py, csrc/quant/exl2_gemv_left.cuh).

The leave op's partials are checked against their meaning in torch (summed in split order, + bias, rounded: the
reduction gate/up skips, `_summed`), the gated op against the gated GEMV over gate/up's reduced output.

Exact: down sums each value's partials in split order from zero, adds the bias and rounds once, as the reduction gate/up
skips (gv_reduce_partials_vec4), then applies silu_mul as the gated gather does, so down's output and the residual
stream are bit-identical to gate/up (norm-fused or after the pre-gathering norm) followed by the gated GEMV. Shapes:
every width of gate and up in a mixed layout, down with an act-order permutation, hidden sizes of one and several
column blocks, 1 to 8 rows, bias on gate or up, split counts from 4 to 12 (odd ones included), a CUDA graph, the
model forward with the switch on and off. The host-side plan (splits, layout, routing) runs wherever the library
loads.
"""

from __future__ import annotations

import pytest
import torch

from exl2_backend.errors import TensorShapeError
from exl2_backend.ops import library
from tests.kernels.test_exl2_dequant import _to_cuda, make_qt
from tests.kernels.test_gemv_norm import _layout
from tests.kernels.tma_gemv import needs_tma_gemv, rand_half


def _mlp(hidden: int, inter: int, bits: int, seed: int, bias: str = "", device="cuda"):
    """(gate_up, down) linears: gate and up [hidden -> inter] at `bits` (mixed), down [inter -> hidden] at 4 / 8
    bits; bias "gate" / "up" puts one on that part."""
    from exl2_backend.ops import cuda_quant

    gate = make_qt(_layout(hidden, bits), inter, seed=seed, bias=bias == "gate", key="gate")
    up = make_qt(_layout(hidden, UP_BITS[bits]), inter, seed=seed + 1, bias=bias == "up", key="up")
    down = make_qt(_layout(inter, 4), hidden, seed=seed + 2, key="down")
    if device == "cuda":
        return (cuda_quant.prepare_linear([_to_cuda(gate), _to_cuda(up)], "cuda"),
                cuda_quant.prepare_linear([_to_cuda(down)], "cuda"))
    cpu = torch.device("cpu")  # host-side plan only (prepare_linear places ops on a GPU)
    pack = cuda_quant.pack_qtensor
    return (cuda_quant.CudaLinearOp([pack(gate, cpu), pack(up, cpu)], cpu),
            cuda_quant.CudaLinearOp([pack(down, cpu)], cpu))


UP_BITS = {2: 6, 3: 2, 4: 3, 5: 4, 6: 5, 8: 6}  # up's width beside gate's: every width on each part


def _reference(gate_up, down, h, residual, w, eps, pregather):
    y, res = gate_up.add_normed(h, residual, w, eps, always=True, pregather=pregather)
    return down.gated(y), res


def _summed(partials: torch.Tensor, launch, m: int) -> torch.Tensor:
    """The output [M, N] the left partials stand for, in torch: each part's splits summed in order from zero in fp32,
    plus the bias, rounded to fp16 once (the reduction gate/up skips)."""
    from exl2_backend.ops import cuda_left

    offsets, _ = cuda_left.partials_layout(launch, m)
    flat, outs = partials.reshape(-1), []
    for part, k, off in zip(launch.parts, cuda_left.left_splits(launch, m), offsets):
        splits = flat[off : off + k * m * part.Np].view(k, m, part.Np)  # [k, M, Np]
        v = torch.zeros(m, part.Np, dtype=torch.float32, device=partials.device)
        for s in range(k):
            v = v + splits[s]
        v = v[:, : part.N]
        if part.bias is not None:
            v = v + part.bias[: part.N].float()
        outs.append(v.half())
    return torch.cat(outs, dim=1)


# (hidden, inter, m, pregather): False the norm inside gate/up (one or several passes), True the pre-gathering norm.
CASES = [(576, 1536, 1, False), (576, 1536, 2, False), (576, 1536, 3, True), (576, 1536, 5, True),
         (576, 1536, 8, True), (1056, 2816, 1, False), (1056, 2816, 4, True), (2048, 8192, 1, False),
         (2048, 8192, 5, True)]


@pytest.mark.cuda
@pytest.mark.parametrize("bits", [2, 3, 4, 5, 6, 8])
@pytest.mark.parametrize("hidden,inter,m,pregather", CASES)
def test_left_partials_equal_the_reduced_gate_up(monkeypatch, bits, hidden, inter, m, pregather):
    from exl2_backend.ops import cuda_left

    needs_tma_gemv("left split-K partials")
    monkeypatch.setattr(cuda_left, "LEFT_PARTIALS", True)
    gate_up, down = _mlp(hidden, inter, bits, seed=bits * 7 + m, bias=("", "gate", "up")[bits % 3])
    w = rand_half((hidden,), seed=hidden, scale=0.3) + 1
    h, residual = rand_half((m, hidden), seed=m), rand_half((m, hidden), seed=m + 40, scale=4.0)
    h0, r0 = h.clone(), residual.clone()
    gu = gate_up.launch
    for res in (residual, None):
        # the leave op alone: its partials sum (torch, in split order) to gate/up's reduced output
        partials, _ = torch.ops.exl2_backend.exl2_gemv_add_norm_leave(h, res, w, 1e-5, gu.parts[0].packed, gu.handle,
                                                                      gate_up.workspace.counters, pregather)
        y, _ = gate_up.add_normed(h, res, w, 1e-5, always=True, pregather=pregather)
        assert torch.equal(_summed(partials, gu, m), y)
        got = cuda_left.gate_up_down(gate_up, down, h, res, w, 1e-5, pregather=pregather)
        assert got is not None, "the left partials declined"
        want = _reference(gate_up, down, h, res, w, 1e-5, pregather)
        assert torch.equal(got[0], want[0])
        assert torch.equal(got[1], h if res is None else want[1])
    assert torch.equal(h, h0) and torch.equal(residual, r0)  # inputs untouched


@pytest.mark.cuda
def test_left_partials_cover_split_counts_past_one_round():
    """The cases above sum more splits than one round of the gather's loads (kLeftSplitStep = 2), odd counts too,
    within the gather's bound."""
    from exl2_backend.ops import cuda_left

    needs_tma_gemv("left split-K partials")
    counts = set()
    for hidden, inter, m, _ in CASES:
        gate_up, _down = _mlp(hidden, inter, 4, seed=1)
        counts.update(cuda_left.left_splits(gate_up.launch, m))
    assert any(k > 2 and k % 2 for k in counts) and max(counts) <= cuda_left.MAX_SPLITS, counts


@pytest.mark.cuda
def test_left_partials_replay_in_a_cuda_graph(monkeypatch):
    from exl2_backend.ops import cuda_left

    needs_tma_gemv("left split-K partials")
    monkeypatch.setattr(cuda_left, "LEFT_PARTIALS", True)
    gate_up, down = _mlp(576, 1536, 4, seed=5, bias="up")
    w = rand_half((576,), seed=2, scale=0.3) + 1
    h, residual = rand_half((1, 576), seed=3), rand_half((1, 576), seed=4)
    cuda_left.gate_up_down(gate_up, down, h, residual, w, 1e-5)  # warm-up outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, res = cuda_left.gate_up_down(gate_up, down, h, residual, w, 1e-5)
    for seed in (10, 11):
        h.copy_(rand_half((1, 576), seed=seed))
        residual.copy_(rand_half((1, 576), seed=seed + 1))
        graph.replay()
        want = _reference(gate_up, down, h, residual, w, 1e-5, False)
        assert torch.equal(out, want[0]) and torch.equal(res, want[1])


@pytest.mark.cuda
def test_left_partials_bad_inputs(monkeypatch):
    from exl2_backend.ops import cuda_left

    needs_tma_gemv("left split-K partials")
    monkeypatch.setattr(cuda_left, "LEFT_PARTIALS", True)
    gate_up, down = _mlp(576, 1536, 4, seed=6)
    w = rand_half((576,), seed=2) + 1
    h = rand_half((2, 576), seed=3)
    partials, _ = torch.ops.exl2_backend.exl2_gemv_add_norm_leave(h, None, w, 1e-5, gate_up.launch.parts[0].packed,
                                                                  gate_up.launch.handle, down.workspace.counters,
                                                                  False)
    for bad_h in (h[:, :-8], h.float()):  # the leave op checks its input as the norm-fused GEMV does
        with pytest.raises(TensorShapeError):
            torch.ops.exl2_backend.exl2_gemv_add_norm_leave(bad_h, None, w, 1e-5, gate_up.launch.parts[0].packed,
                                                            gate_up.launch.handle, down.workspace.counters, False)
    ws, counters = down.workspace.buffers()
    packed, handle = down.launch.parts[0].packed, down.launch.handle
    for bad in (partials[:, :-1].contiguous(), partials.half(), partials.new_zeros(9, partials.shape[1])):
        with pytest.raises(TensorShapeError):
            torch.ops.exl2_backend.exl2_gemv_gated_left(bad, packed, handle, gate_up.launch.handle, ws, counters)
    other_up, _ = _mlp(576, 1024, 4, seed=7)  # a producer whose parts are not down's width
    with pytest.raises(TensorShapeError):
        torch.ops.exl2_backend.exl2_gemv_gated_left(partials, packed, handle, other_up.launch.handle, ws, counters)
    assert cuda_left.gate_up_down(gate_up, down, rand_half((9, 576), seed=1), None, w, 1e-5) is None  # M > MAX_M
    monkeypatch.setattr(cuda_left, "LEFT_PARTIALS", False)
    assert cuda_left.gate_up_down(gate_up, down, h, None, w, 1e-5) is None


@pytest.mark.cuda
def test_model_forward_bit_identical_with_left_partials(tmp_path, monkeypatch):
    """LlamaModel: a 5-token prefill, then decode steps of 1 and 3 sequences; logits equal bit for bit with the
    left partials on and off (the 5-token prefill and the 3-sequence step run the pre-gathering norm)."""
    from exl2_backend.model.llama import LlamaModel
    from exl2_backend.ops import cuda_left
    from tests.helpers.forward_steps import prefill_then_decode
    from tests.helpers.synth import tiny_config_dict, write_tiny_exl2_model

    needs_tma_gemv("left split-K partials")
    cfg = tiny_config_dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2)
    model = LlamaModel.from_dir(write_tiny_exl2_model(tmp_path / "m", cfg, seed=3), "cuda")
    layer = model.layers[0]
    monkeypatch.setattr(cuda_left, "LEFT_PARTIALS", True)
    assert cuda_left.takes(layer.gate_up, layer.down, 1) and cuda_left.takes(layer.gate_up, layer.down, 5)

    def run(on: bool) -> list[torch.Tensor]:
        monkeypatch.setattr(cuda_left, "LEFT_PARTIALS", on)
        return prefill_then_decode(model)

    for a, b in zip(run(True), run(False)):
        assert torch.equal(a, b)


@pytest.mark.skipif(not library.available(), reason="compiled library not loaded")
def test_partials_layout_follows_the_split_plan_cpu(monkeypatch):
    """Host side: each part's partials block holds its planned splits x M x Np floats, the parts one after the other,
    and routing declines off the TMA GEMV (here: no GPU, row cap 8) and with the switch off."""
    from exl2_backend.ops import cuda_left, cuda_quant

    gate_up, down = _mlp(576, 1536, 4, seed=8, device="cpu")
    launch = gate_up.launch
    for m in (1, 5, 8):
        ks = cuda_left.left_splits(launch, m)
        assert ks == [sum(runs) for runs in launch.gemv_splits(m)[0]] and min(ks) >= 1
        offsets, row = cuda_left.partials_layout(launch, m)
        np_ = [p.Np for p in launch.parts]
        assert offsets == [0, ks[0] * m * np_[0]] and row == ks[0] * np_[0] + ks[1] * np_[1]
    monkeypatch.setattr(cuda_left, "LEFT_PARTIALS", True)
    assert not cuda_left.takes(gate_up, down, 1)  # the CPU's row cap: not the TMA GEMV
    monkeypatch.setattr(cuda_quant, "gemv_row_cap", lambda device: 32)
    monkeypatch.setattr(cuda_left, "gemv_row_cap", lambda device: 32)
    assert cuda_left.takes(gate_up, down, 1) and cuda_left.takes(gate_up, down, 8)
    assert not cuda_left.takes(gate_up, down, 9) and not cuda_left.takes(down, gate_up, 1)
    monkeypatch.setattr(cuda_left, "LEFT_PARTIALS", False)
    assert not cuda_left.takes(gate_up, down, 1)
