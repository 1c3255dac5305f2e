"""RMSNorm split across two TMA GEMVs (ops/cuda_split_norm.py, csrc/quant/exl2_gemv_norm_partials.cuh): the producer
adds the residual in place and leaves block partials of its rows' sums of squares, the consumer normalizes its own
rows from them.

Exact: every norm of the library sums squares in one order (csrc/layers/rms_ssq.cuh), so the producer's stream is
add_rms_norm's residual output and the consumer's output is add_rms_norm followed by the plain GEMV, bit for bit;
the same holds against the norm inside the GEMV and the pre-gathering norm. Shapes: hidden sizes with a partial last
256-column block (576, 1056) and the 8B's 4096, every bit width, M from 1 to 32 (one to four token tiles), a gated
producer (down_proj's silu(gate) * up), the fused rope; the model forward with the split on and off; bad inputs.
"""

from __future__ import annotations

import pytest
import torch

from exl2_backend.errors import TensorShapeError
from tests.kernels.test_exl2_dequant import _to_cuda, make_qt
from tests.kernels.test_gemv_norm import _layout, _needs_tma, _rand

pytestmark = pytest.mark.cuda


def _op(k: int, n: int, bits: int, seed: int, key: str = "t"):
    from exl2_backend.ops import cuda_quant

    return cuda_quant.prepare_linear([_to_cuda(make_qt(_layout(k, bits), n, seed=seed, key=key))], "cuda")


def _split_vs_apart(producer, consumer, x, residual, w, gated=False, eps=1e-5, stored=False):
    """Producer + consumer against the plain GEMV, add_rms_norm and the plain GEMV; returns (stream, ssq). stored:
    the producer also writes the consumer's stored row order, which the consumer copies."""
    from exl2_backend import ops

    x0, r0 = x.clone(), residual.clone()
    stream, ssq, xp = producer.add_residual(x, residual, gated=gated, consumer=consumer if stored else None)
    assert (xp is not None) == stored
    if stored:
        xp_stored = xp.clone()
        xp.fill_(float("nan"))  # padding rows are never written: the consumer must not read them
        valid = (consumer.launch.parts[0].xmap.long() & 0xFFFF) != 0xFFFF
        xp[:, :, : valid.numel()][:, :, valid] = xp_stored[:, :, : valid.numel()][:, :, valid]
        for q, part in enumerate(consumer.launch.parts):  # the stream, permuted into each part's stored order
            rows = part.xmap.long() & 0xFFFF
            ok = rows != 0xFFFF
            assert torch.equal(xp_stored[q][:, : rows.numel()][:, ok], stream[:, rows[ok]])
    y = consumer.normed_from_partials(stream, ssq, w, eps, xp)
    h = producer.gated(x) if gated else producer.fused_kernel(x, "gemv")
    normed, want_stream = ops.add_rms_norm(h, residual.clone(), w, eps)
    assert torch.equal(stream, want_stream)
    assert torch.equal(y, consumer.fused_kernel(normed.contiguous(), "gemv"))
    assert torch.equal(x, x0) and torch.equal(residual, r0)  # inputs untouched
    want_ssq = stream.double().pow(2).sum(1)
    torch.testing.assert_close(ssq.double().sum(1), want_ssq, rtol=1e-5, atol=0)
    return stream, ssq


# (hidden, m): partial last blocks (576 = 2.25 x 256, 1056 = 4.125 x 256), one to four token tiles
SPLIT_CASES = [(576, 1), (576, 32), (1056, 5), (1056, 17), (4096, 1), (4096, 5), (4096, 9)]


@pytest.mark.parametrize("stored", [False, True])
@pytest.mark.parametrize("bits", [2, 3, 4, 5, 6, 8])
@pytest.mark.parametrize("hidden,m", SPLIT_CASES)
def test_split_norm_equals_add_rms_norm_between_plain_gemvs(bits, hidden, m, stored):
    _needs_tma()
    producer = _op(320, hidden, bits, seed=bits + m, key="o")  # o_proj-like: 320 -> hidden
    consumer = _op(hidden, 192, {2: 8, 3: 6, 4: 5, 5: 4, 6: 3, 8: 2}[bits], seed=bits * 3 + m, key="g")
    w = _rand((hidden,), seed=hidden, scale=0.3) + 1
    x, residual = _rand((m, 320), seed=m), _rand((m, hidden), seed=m + 50, scale=4.0)
    _split_vs_apart(producer, consumer, x, residual, w, stored=stored)


@pytest.mark.parametrize("m", [1, 5, 32])
def test_split_norm_gated_producer_and_the_fused_norms_agree(m):
    """down_proj-like producer (gate | up input); its stream and partials feed a consumer whose output equals the norm
    inside the GEMV (one pass) and the pre-gathering norm, all three being add_rms_norm's order."""
    _needs_tma()
    hidden, inter = 1056, 704
    producer = _op(inter, hidden, 4, seed=7, key="down")
    consumer = _op(hidden, 320, 3, seed=8, key="qkv")
    w = _rand((hidden,), seed=1, scale=0.3) + 1
    gate_up, residual = _rand((m, 2 * inter), seed=2), _rand((m, hidden), seed=3, scale=4.0)
    stream, ssq = _split_vs_apart(producer, consumer, gate_up, residual, w, gated=True, stored=m > 1)
    y = consumer.normed_from_partials(stream, ssq, w, 1e-5)
    for pregather in (False, True):
        fused = consumer.add_normed(stream, None, w, 1e-5, always=not pregather, pregather=pregather)
        if fused is not None:  # the norm inside the GEMV takes few rows of 1056
            assert torch.equal(fused[0], y)


def test_split_norm_consumer_with_rope_equals_add_normed_rope_kv():
    """q/k/v consumer with rope and the fp16 KV write inside the launch: the same q / k / v and cache rows as the
    norm inside the GEMV with its rope (whose input norm is add_rms_norm's order too)."""
    from exl2_backend.ops import cuda_quant

    _needs_tma()
    hidden, d, hq, hk, m = 576, 64, 4, 2, 3
    parts = [_to_cuda(make_qt(_layout(hidden, b), n, seed=b, key=k)) for b, n, k in ((4, hq * d, "q"),
                                                                                     (3, hk * d, "k"), (6, hk * d, "v"))]
    qkv = cuda_quant.prepare_linear(parts, "cuda")
    producer = _op(256, hidden, 4, seed=4, key="down")
    w = _rand((hidden,), seed=5, scale=0.3) + 1
    stream, ssq, xp = producer.add_residual(_rand((m, 256), seed=6), _rand((m, hidden), seed=7, scale=4.0),
                                            consumer=qkv)  # three parts of different stored orders
    positions = torch.tensor([3, 9, 100], device="cuda")
    inv_freq = 1.0 / (10000 ** (torch.arange(0, d, 2, device="cuda").float() / d))
    slots = torch.tensor([3, 9, -1], device="cuda")  # -1: not written
    caches = [torch.zeros(4, 32, hk, d, dtype=torch.float16, device="cuda") for _ in range(4)]
    got = qkv.normed_from_partials_rope_kv(stream, ssq, w, 1e-5, positions, inv_freq, caches[0], caches[1], slots,
                                           xp)
    want = qkv.add_normed_rope_kv(stream, None, w, 1e-5, positions, inv_freq, caches[2], caches[3], slots,
                                  pregather=False)
    assert got is not None and want is not None
    assert torch.equal(got, want[0])
    assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])


def test_split_norm_in_a_cuda_graph():
    """Captured once, replayed on new inputs: the same bits as eager calls (the block partials are rewritten every
    replay and the split-K tickets are left at zero)."""
    _needs_tma()
    producer, consumer = _op(320, 4096, 4, seed=1), _op(4096, 512, 4, seed=2)
    w = _rand((4096,), seed=3) + 1
    x, residual = _rand((1, 320), seed=4), _rand((1, 4096), seed=5)
    stream, ssq, xp = producer.add_residual(x, residual, consumer=consumer)  # warm-up outside the graph
    consumer.normed_from_partials(stream, ssq, w, 1e-5, xp)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        g_stream, g_ssq, g_xp = producer.add_residual(x, residual, consumer=consumer)
        g_y = consumer.normed_from_partials(g_stream, g_ssq, w, 1e-5, g_xp)
    for seed in (10, 11):
        x.copy_(_rand((1, 320), seed=seed))
        residual.copy_(_rand((1, 4096), seed=seed + 1))
        graph.replay()
        stream, ssq, _ = producer.add_residual(x, residual)
        assert torch.equal(g_stream, stream) and torch.equal(g_ssq, ssq)
        assert torch.equal(g_y, consumer.normed_from_partials(stream, ssq, w, 1e-5))


def test_split_norm_refuses_bad_inputs():
    from exl2_backend.ops import cuda_quant

    _needs_tma()
    hidden = 576
    producer, consumer = _op(320, hidden, 4, seed=1), _op(hidden, 256, 4, seed=2)
    w = _rand((hidden,), seed=3) + 1
    x, residual = _rand((2, 320), seed=4), _rand((2, hidden), seed=5)
    stream, ssq, _ = producer.add_residual(x, residual)
    with pytest.raises(TensorShapeError):  # a consumer of another width
        producer.add_residual(x, residual, consumer=_op(320, 64, 4, seed=9))
    with pytest.raises(TensorShapeError):  # a stored-order copy of the wrong shape
        consumer.normed_from_partials(stream, ssq, w, 1e-5, stream.new_zeros(1, 2, 512))
    with pytest.raises(TensorShapeError):  # residual of the wrong width
        producer.add_residual(x, residual[:, :-8].contiguous())
    with pytest.raises(TensorShapeError):  # residual rows not 16-byte aligned
        producer.add_residual(x, _rand((2, hidden + 1), seed=6)[:, 1:])
    with pytest.raises(TensorShapeError):  # x of the wrong width
        producer.add_residual(_rand((2, 328), seed=7), residual)
    with pytest.raises(TensorShapeError):  # partials of the wrong shape, or fp16
        consumer.normed_from_partials(stream, ssq[:, :-1].contiguous(), w, 1e-5)
    with pytest.raises(TensorShapeError):
        consumer.normed_from_partials(stream, ssq.half(), w, 1e-5)
    with pytest.raises(TensorShapeError):  # norm weight of the wrong length
        consumer.normed_from_partials(stream, ssq, w[:-8], 1e-5)
    with pytest.raises(TensorShapeError):  # more rows than the GEMV takes
        consumer.normed_from_partials(_rand((33, hidden), seed=8), ssq.new_zeros(33, 3), w, 1e-5)
    two_parts = cuda_quant.prepare_linear([_to_cuda(make_qt(_layout(320, 4), 288, seed=s, key=f"p{s}"))
                                           for s in (1, 2)], "cuda")
    with pytest.raises(TensorShapeError):  # a producer of two parts (its stream would be two tensors)
        two_parts.add_residual(x, _rand((2, 576), seed=9))
    assert not producer.takes_split_norm(33)


def test_model_forward_bit_identical_with_and_without_the_split_norm(tmp_path, monkeypatch):
    """LlamaModel: a 5-token prefill, then decode steps of 1 and 3 sequences (tests/helpers/forward_steps.py); logits
    equal bit for bit with layers.SPLIT_NORM on (the norms between o_proj and the next q/k/v split across the
    GEMVs; the stored-order copy from 1 row or from 2) and off (the norm inside the consumer GEMV or the
    pre-gathering norm)."""
    from exl2_backend.model import layers
    from exl2_backend.model.llama import LlamaModel
    from tests.helpers.forward_steps import prefill_then_decode
    from tests.helpers.synth import tiny_config_dict, write_tiny_exl2_model

    _needs_tma()
    cfg = tiny_config_dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2)
    d = write_tiny_exl2_model(tmp_path / "m", cfg, seed=3)
    model = LlamaModel.from_dir(d, "cuda")
    assert model.layers[0]._takes_split_norm(3, model.layers[1], None)
    calls = []
    real = type(model.layers[0].o).add_residual
    monkeypatch.setattr(type(model.layers[0].o), "add_residual", lambda *a, **k: calls.append(1) or real(*a, **k))

    def run(on: bool) -> list[torch.Tensor]:
        monkeypatch.setattr(layers, "SPLIT_NORM", on)
        return prefill_then_decode(model)

    off = run(False)
    assert not calls
    for stored_from in (1, 2):
        monkeypatch.setattr(layers, "SPLIT_NORM_STORED_FROM", stored_from)
        on = run(True)
        assert calls  # the split path ran
        for a, b in zip(on, off):
            assert torch.equal(a, b)
