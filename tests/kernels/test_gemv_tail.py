"""The next GEMV's input norm as the tail of the producing GEMV (ops/cuda_tail.py, csrc/quant/exl2_gemv_tail.cuh).

Exact: the tail normalizes with gv_norm_rows (the norm kernel's threads per row, vector order and roundings) and
scatters with pregather_rows_from, as exl2_add_norm_pregather does, so the producer's output, the residual stream
and the consumer's output are bit-identical to producer GEMV + add_normed(pregather=True). Shapes: every bit width
of the producer in a mixed layout, hidden sizes with 8, 4, 2 and 1 rows per tail job (576, 1056, 4096, 8192), 1-8
rows (one to eight jobs, jobs of fewer rows than a pass), plain and gated (down's silu_mul) producers, consumers of
two and three parts of different padded lengths, with and without a residual; repeated launches and a CUDA graph
(the two counter words re-armed), the q/k/v consumer's fused rope and KV write, bad inputs, and the model forward
with the tail on and off.
"""

from __future__ import annotations

import pytest
import torch

from exl2_backend.errors import TensorShapeError
from tests.kernels.test_exl2_dequant import _to_cuda, make_qt
from tests.kernels.test_gemv_norm import _layout
from tests.kernels.tma_gemv import needs_tma_gemv, rand_half


def _pair(k_in: int, hidden: int, bits: int, widths: tuple[int, ...], seed: int):
    """(producer [k_in -> hidden], consumer of len(widths) parts [hidden -> widths], bias on the last part)."""
    from exl2_backend.ops import cuda_quant

    producer = cuda_quant.prepare_linear([_to_cuda(make_qt(_layout(k_in, bits), hidden, seed=seed, bias=bits == 4))],
                                         "cuda")
    parts = [_to_cuda(make_qt(_layout(hidden, b), n, seed=seed + 1 + i, bias=i == len(widths) - 1, key=f"c{i}"))
             for i, (b, n) in enumerate(zip((4, 3, 6), widths))]
    return producer, cuda_quant.prepare_linear(parts, "cuda")


def _tail(producer, consumer, x, residual, w, gate_off=0, eps=1e-5):
    """(h, residual out, consumer output) through the tail ops."""
    ws, counters = producer.workspace.buffers()
    pl, cl = producer.launch, consumer.launch
    h, res, pre = torch.ops.exl2_backend.exl2_gemv_norm_tail(x, gate_off, residual, w, eps, pl.parts[0].packed,
                                                             pl.handle, ws, counters, cl.parts[0].packed, cl.handle,
                                                             producer.tail_counters())
    y = torch.ops.exl2_backend.exl2_gemv_pregathered(pre, h, cl.parts[0].packed, cl.handle, ws, counters)
    return h, res, y


def _want(producer, consumer, x, residual, w, gated=False, eps=1e-5):
    h = producer.gated(x) if gated else producer.fused_kernel(x, "gemv")
    y, res = consumer.add_normed(h, residual, w, eps, pregather=True)
    return h, res, y


def _assert_same(got, want, residual):
    h, res, y = got
    assert torch.equal(h, want[0])
    if residual is not None:
        assert torch.equal(res, want[1])
    assert torch.equal(y, want[2])


# (hidden, rows per tail job, M): one to eight jobs, a last job of fewer rows than a pass
TAIL_CASES = [(576, 1), (576, 8), (1056, 3), (1056, 6), (4096, 1), (4096, 3), (4096, 5), (4096, 8), (8192, 3)]


@pytest.mark.cuda
@pytest.mark.parametrize("bits", [2, 3, 4, 5, 6, 8])
@pytest.mark.parametrize("hidden,m", TAIL_CASES)
def test_tail_equals_gemv_then_pregathering_norm(bits, hidden, m):
    needs_tma_gemv("the norm tail")
    producer, consumer = _pair(1056, hidden, bits, (320, 200), seed=bits * 7 + m)
    w = rand_half((hidden,), seed=hidden, scale=0.3) + 1
    x, residual = rand_half((m, 1056), seed=m), rand_half((m, hidden), seed=m + 50, scale=4.0)
    x0, r0 = x.clone(), residual.clone()
    _assert_same(_tail(producer, consumer, x, residual, w), _want(producer, consumer, x, residual, w), residual)
    assert torch.equal(x, x0) and torch.equal(residual, r0)  # inputs untouched
    _assert_same(_tail(producer, consumer, x, None, w), _want(producer, consumer, x, None, w), None)
    torch.cuda.synchronize()
    assert producer.tail_counters().tolist() == [0, 0]  # re-armed for the next launch


@pytest.mark.cuda
@pytest.mark.parametrize("m", [1, 3, 5, 8])
@pytest.mark.parametrize("inter", [640, 2048])
def test_gated_tail_three_part_consumer(m, inter):
    """down -> the next layer's q/k/v: the producer gathers silu(gate) * up (pre-gathered or in the GEMV, as its plan
    says), the consumer has three parts of different padded lengths."""
    needs_tma_gemv("the norm tail")
    hidden = 1024
    producer, consumer = _pair(inter, hidden, 4, (512, 128, 136), seed=m)
    w = rand_half((hidden,), seed=3, scale=0.3) + 1
    gate_up, residual = rand_half((m, 2 * inter), seed=m + 1), rand_half((m, hidden), seed=m + 2)
    got = _tail(producer, consumer, gate_up, residual, w, gate_off=inter)
    _assert_same(got, _want(producer, consumer, gate_up, residual, w, gated=True), residual)


@pytest.mark.cuda
def test_tail_repeats_and_replays_in_a_cuda_graph():
    """Launch after launch and replay after replay on fresh inputs: each result as the ops apart (the counter words
    are re-armed by the last job every time)."""
    needs_tma_gemv("the norm tail")
    producer, consumer = _pair(1056, 4096, 4, (320, 200), seed=1)
    w = rand_half((4096,), seed=2) + 1
    x, residual = rand_half((5, 1056), seed=3), rand_half((5, 4096), seed=4)
    for _ in range(3):
        _assert_same(_tail(producer, consumer, x, residual, w), _want(producer, consumer, x, residual, w), residual)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = _tail(producer, consumer, x, residual, w)
    for seed in (10, 20, 30):
        x.copy_(rand_half((5, 1056), seed=seed))
        residual.copy_(rand_half((5, 4096), seed=seed + 1))
        graph.replay()
        _assert_same(out, _want(producer, consumer, x, residual, w), residual)
    torch.cuda.synchronize()
    assert producer.tail_counters().tolist() == [0, 0]


@pytest.mark.cuda
@pytest.mark.parametrize("m", [3, 5, 8])
def test_tail_into_the_fused_rope_and_kv_write(m):
    """The q/k/v consumer with its rope and fp16 KV write in the GEMV: qkv, residual and both caches as down +
    add_normed_rope_kv(pregather=True)."""
    from exl2_backend.ops import cuda_quant
    from tests.kernels.test_gemv_rope_kv import _qkv, _step

    needs_tma_gemv("the norm tail")

    hq, hk, d, hidden, inter = 8, 2, 128, 1024, 640
    consumer = _qkv(hidden, hq, hk, d, "4.0", seed=5)
    producer = cuda_quant.prepare_linear([_to_cuda(make_qt(_layout(inter, 4), hidden, seed=6))], "cuda")
    w = rand_half((hidden,), seed=7) + 1
    gate_up, residual = rand_half((m, 2 * inter), seed=8), rand_half((m, hidden), seed=9)
    positions, inv_freq, kc, vc, slots = _step(m, hk, d, seed=10)
    kc1, vc1, kc2, vc2 = kc.clone(), vc.clone(), kc.clone(), vc.clone()
    ws, counters = producer.workspace.buffers()
    pl, cl = producer.launch, consumer.launch
    h, res, pre = torch.ops.exl2_backend.exl2_gemv_norm_tail(gate_up, inter, residual, w, 1e-5, pl.parts[0].packed,
                                                             pl.handle, ws, counters, cl.parts[0].packed, cl.handle,
                                                             producer.tail_counters())
    y = torch.ops.exl2_backend.exl2_gemv_pregathered_rope_kv(pre, h, cl.parts[0].packed, cl.handle, ws, counters,
                                                             positions, inv_freq, kc1, vc1, slots)
    h2 = producer.gated(gate_up)
    want = consumer.add_normed_rope_kv(h2, residual, w, 1e-5, positions, inv_freq, kc2, vc2, slots, pregather=True)
    assert want is not None
    assert torch.equal(h, h2) and torch.equal(res, want[1]) and torch.equal(y, want[0])
    assert torch.equal(kc1, kc2) and torch.equal(vc1, vc2)


@pytest.mark.cuda
def test_tail_refuses_bad_inputs():
    needs_tma_gemv("the norm tail")
    producer, consumer = _pair(1056, 576, 4, (320, 200), seed=2)
    _, other = _pair(1056, 1024, 4, (64, 64), seed=3)
    w = rand_half((576,), seed=1) + 1
    x, r = rand_half((3, 1056), seed=2), rand_half((3, 576), seed=3)
    ws, counters = producer.workspace.buffers()
    pl = producer.launch

    def call(x=x, r=r, w=w, consumer=consumer, cnt=None, gate_off=0):
        cl = consumer.launch
        return torch.ops.exl2_backend.exl2_gemv_norm_tail(x, gate_off, r, w, 1e-5, pl.parts[0].packed, pl.handle, ws,
                                                          counters, cl.parts[0].packed, cl.handle,
                                                          producer.tail_counters() if cnt is None else cnt)

    for bad in ({"x": rand_half((3, 1064), seed=4)}, {"x": rand_half((9, 1056), seed=4)},
                {"x": x.float()}, {"w": w[:-8]}, {"w": w.float()}, {"r": rand_half((3, 584), seed=5)},
                {"consumer": other}, {"cnt": torch.zeros(2, dtype=torch.int64, device="cuda")},
                {"gate_off": 500}):
        with pytest.raises(TensorShapeError):
            call(**bad)
    h, _, pre = call()
    with pytest.raises(TensorShapeError):  # the consumer's input of fewer rows than h says
        torch.ops.exl2_backend.exl2_gemv_pregathered(pre[:-8], h, consumer.launch.parts[0].packed,
                                                     consumer.launch.handle, ws, counters)
    torch.cuda.synchronize()
    assert producer.tail_counters().tolist() == [0, 0]


@pytest.mark.cuda
def test_model_forward_bit_identical_with_and_without_the_tail(tmp_path, monkeypatch):
    """LlamaModel with the norm-fused GEMV capped at two rows (so a 5-token prefill and a 3-sequence decode step
    take the pre-gathering norm, which the tail replaces): logits equal bit for bit with the tail on and off, and
    the tail runs for o -> gate/up and for down -> the next layer's q/k/v."""
    from exl2_backend.model.llama import LlamaModel
    from exl2_backend.ops import cuda_quant, cuda_tail
    from tests.helpers.forward_steps import assert_same_with_switch
    from tests.helpers.synth import tiny_config_dict, write_tiny_exl2_model

    needs_tma_gemv("the norm tail")
    cfg = tiny_config_dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2)
    monkeypatch.setattr(cuda_quant, "NORM_SMEM_BYTES", 2 * 256 * 2)
    model = LlamaModel.from_dir(write_tiny_exl2_model(tmp_path / "m", cfg, seed=3), "cuda")
    ran = []
    real = cuda_tail.linear_norm_linear

    def counting(*args, **kwargs):
        out = real(*args, **kwargs)
        ran.append((kwargs.get("gated", False), kwargs.get("rope") is not None, out is not None))
        return out

    monkeypatch.setattr(cuda_tail, "linear_norm_linear", counting)
    assert_same_with_switch(model, monkeypatch, cuda_tail, "NORM_TAIL")
    assert (False, False, True) in ran and (True, True, True) in ran  # o -> gate/up; down -> q/k/v with its rope


def test_tail_declines_off_the_gpu_or_when_off(monkeypatch):
    """Routing: reference (CPU) linears and tensor parallel's wrappers (their all-reduce comes between the GEMV and
    the norm) never take the tail, and with EXL2_BACKEND_NORM_TAIL off nothing does."""
    from exl2_backend import ops
    from exl2_backend.model.tensor_parallel import GatherInput, ReduceOutput
    from exl2_backend.ops import cuda_tail
    from tests.kernels.test_exl2_dequant import make_qt as mk

    a = ops.prepare_linear([mk([(4, 64)], 64, seed=1)], "cpu", torch.float16)
    b = ops.prepare_linear([mk([(4, 64)], 32, seed=2)], "cpu", torch.float16)
    assert not cuda_tail.takes(a, b, 3)
    assert not cuda_tail.takes(ReduceOutput(a, None), b, 3) and not cuda_tail.takes(GatherInput(a, None), b, 3)
    x, r, w = torch.zeros(3, 64, dtype=torch.float16), torch.zeros(3, 64, dtype=torch.float16), torch.ones(64).half()
    monkeypatch.setattr(cuda_tail, "NORM_TAIL", True)
    assert cuda_tail.linear_norm_linear(a, x, b, r, w, 1e-5) is None
    monkeypatch.setattr(cuda_tail, "NORM_TAIL", False)
    assert cuda_tail.linear_norm_linear(a, x, b, r, w, 1e-5) is None
