"""The norm fed by the GEMV before it (ops/cuda_feed.py; csrc/quant/exl2_gemv_norm.cuh gv_feed_finish, gv_fed_rows).

Exact: the feeding GEMV's r is the plain GEMV's output plus the residual, rounded as add_rms_norm rounds it, and the
fed GEMV's output is bit-identical to rms_norm(r) followed by the plain GEMV (every norm kernel sums its squares in
the same tile order). The tile sums themselves are checked against float64 sums (relative 1e-5). Shapes: every bit
width in a mixed layout; hidden sizes of one tile, of a partial last tile and of 16 tiles (256, 576, 4096); M = 1,
3, 5 and, where the raw rows fit, 9 and 32 (the two- and four-tile kernels); producers with split-K and without
(K = 64: one chunk), plain and gated (down's silu(gate) * up), with bias; consumers of one and three parts; the
model forward with the feed on and off.
"""

from __future__ import annotations

import pytest
import torch

from exl2_backend.errors import TensorShapeError
from tests.kernels.test_exl2_dequant import _to_cuda, make_qt
from tests.kernels.test_gemv_norm import _layout
from tests.kernels.tma_gemv import needs_tma_gemv, rand_half

pytestmark = pytest.mark.cuda


def _feed(op, x, residual, gated=False):
    from exl2_backend.ops import cuda_feed

    got = cuda_feed.feed(op, x, residual, gated=gated)
    assert got is not None, "the feed declined"
    return got


def _tile_sums(r: torch.Tensor) -> torch.Tensor:
    """float64 sums of squares of r [M, H] per 256-column tile -> [M, ceil(H / 256)]."""
    m, h = r.shape
    t = -(-h // 256)
    padded = torch.zeros(m, t * 256, dtype=torch.float64, device=r.device)
    padded[:, :h] = r.double()
    return (padded.view(m, t, 256) ** 2).sum(-1)


# (producer K, hidden N, M)
FEED_CASES = [(512, 256, 1), (512, 576, 3), (64, 576, 5), (1024, 4096, 1), (1024, 4096, 5), (512, 576, 9),
              (256, 576, 32)]


@pytest.mark.parametrize("bits", [2, 3, 4, 5, 6, 8])
@pytest.mark.parametrize("k,n,m", FEED_CASES)
def test_feed_then_fed_norm_equal_the_ops_one_by_one(bits, k, n, m):
    from exl2_backend import ops
    from exl2_backend.ops import cuda_feed, cuda_quant

    needs_tma_gemv("the fed norm")
    producer = cuda_quant.prepare_linear([_to_cuda(make_qt(_layout(k, bits), n, seed=bits + k, bias=bits == 4))],
                                         "cuda")
    other = {2: 8, 3: 6, 4: 5, 5: 4, 6: 3, 8: 2}[bits]  # the consumer's width
    consumer = cuda_quant.prepare_linear([_to_cuda(make_qt(_layout(n, other), 320, seed=bits * 7 + m))], "cuda")
    x, residual = rand_half((m, k), seed=m), rand_half((m, n), seed=m + 9, scale=4.0)
    x0, res0 = x.clone(), residual.clone()
    r, ss = _feed(producer, x, residual)
    h = producer.fused_kernel(x, "gemv")
    assert torch.equal(r, (h.float() + residual.float()).half())
    assert torch.equal(x, x0) and torch.equal(residual, res0)  # inputs untouched
    assert ss.shape == (m, cuda_feed.tiles(n))
    torch.testing.assert_close(ss.double(), _tile_sums(r), rtol=1e-5, atol=1e-6)

    w = rand_half((n,), seed=n, scale=0.3) + 1
    if not cuda_feed.can_fed_norm(consumer.launch, m):
        return
    y = cuda_feed.fed_normed(consumer, r, ss, w, 1e-5)
    want = consumer.fused_kernel(ops.rms_norm(r, w, 1e-5).contiguous(), "gemv")
    assert torch.equal(y, want)
    got = consumer.add_normed(h, residual, w, 1e-5)  # the same norm fused into the GEMV or pre-gathered
    if got is not None:
        assert torch.equal(got[0], want) and torch.equal(got[1], r)


@pytest.mark.parametrize("m", [1, 5])
def test_gated_feed_and_three_part_consumer(m):
    """down-like: the producer's input silu(gate) * up; q/k/v-like consumer of three parts, one with bias."""
    from exl2_backend import ops
    from exl2_backend.ops import cuda_feed, cuda_quant

    needs_tma_gemv("the fed norm")
    inter, hidden = 640, 576
    down = cuda_quant.prepare_linear([_to_cuda(make_qt(_layout(inter, 3), hidden, seed=4))], "cuda")
    parts = [_to_cuda(make_qt(_layout(hidden, b), nn, seed=b, bias=b == 3, key=f"p{b}"))
             for b, nn in ((4, 576), (3, 192), (6, 192))]
    qkv = cuda_quant.prepare_linear(parts, "cuda")
    gate_up, residual = rand_half((m, 2 * inter), seed=5), rand_half((m, hidden), seed=6, scale=3.0)
    r, ss = _feed(down, gate_up, residual, gated=True)
    assert torch.equal(r, (down.gated(gate_up).float() + residual.float()).half())
    w = rand_half((hidden,), seed=7, scale=0.3) + 1
    y = cuda_feed.fed_normed(qkv, r, ss, w, 1e-6)
    assert torch.equal(y, qkv.fused_kernel(ops.rms_norm(r, w, 1e-6).contiguous(), "gemv"))


def test_feed_routing_and_bad_inputs(monkeypatch):
    from exl2_backend.ops import cuda_feed, cuda_quant

    needs_tma_gemv("the fed norm")
    hidden = 576
    o = cuda_quant.prepare_linear([_to_cuda(make_qt(_layout(512, 4), hidden, seed=1))], "cuda")
    gu = cuda_quant.prepare_linear([_to_cuda(make_qt(_layout(hidden, 4), 640, seed=2))], "cuda")
    assert cuda_feed.feeds_norm(o, gu, 1) and cuda_feed.feeds_norm(o, gu, 32)
    assert not cuda_feed.feeds_norm(gu, o, 1)  # 640 outputs are not o's 512 inputs
    monkeypatch.setattr(cuda_feed, "NORM_SMEM_BYTES", 4 * hidden * 2)  # five raw rows no longer fit
    assert cuda_feed.feeds_norm(o, gu, 4) and not cuda_feed.feeds_norm(o, gu, 5)
    monkeypatch.setattr(cuda_feed, "NORM_FEED", False)
    assert not cuda_feed.feeds_norm(o, gu, 1)

    launch, (ws, counters) = o.launch, o.workspace.buffers()
    x, residual = rand_half((2, 512), seed=3), rand_half((2, hidden), seed=4)
    with pytest.raises(TensorShapeError):  # residual of the wrong width
        torch.ops.exl2_backend.exl2_gemv_feed(x, residual[:, :-8], launch.parts[0].packed, launch.handle, ws,
                                              counters, 0)
    with pytest.raises(TensorShapeError):  # input of the wrong width
        torch.ops.exl2_backend.exl2_gemv_feed(x[:, :-8], residual, launch.parts[0].packed, launch.handle, ws,
                                              counters, 0)
    r, ss = _feed(o, x, residual)
    w = rand_half((hidden,), seed=5) + 1
    g, (gws, gcounters) = gu.launch, gu.workspace.buffers()
    for bad_ss in (ss[:, :-1].contiguous(), ss.double(), ss[:1]):
        with pytest.raises(TensorShapeError):
            torch.ops.exl2_backend.exl2_gemv_fed_norm(r, bad_ss, w, 1e-5, g.parts[0].packed, g.handle, gws, gcounters)
    with pytest.raises(TensorShapeError):  # a weight of the wrong length
        torch.ops.exl2_backend.exl2_gemv_fed_norm(r, ss, w[:-8], 1e-5, g.parts[0].packed, g.handle, gws, gcounters)
    assert cuda_feed.fed_normed(gu, r, ss, w.float(), 1e-5) is None  # an fp32 norm weight: the caller's ops


@pytest.mark.parametrize("hidden,heads,kv", [(256, 4, 2), (576, 9, 3)])
def test_model_forward_bit_identical_with_and_without_the_feed(tmp_path, monkeypatch, hidden, heads, kv):
    """LlamaModel: a 5-token prefill, then decode steps of 1 and 3 sequences (tests/helpers/forward_steps.py); logits
    equal bit for bit with the feed on, off, and with every norm as its own add_rms_norm launch."""
    from exl2_backend.model import layers
    from exl2_backend.model.llama import LlamaModel
    from exl2_backend.ops import cuda_feed
    from tests.helpers.forward_steps import prefill_then_decode
    from tests.helpers.synth import tiny_config_dict, write_tiny_exl2_model

    needs_tma_gemv("the fed norm")
    cfg = tiny_config_dict(hidden_size=hidden, intermediate_size=2 * hidden, num_attention_heads=heads,
                           num_key_value_heads=kv)
    d = write_tiny_exl2_model(tmp_path / "m", cfg, seed=5)
    model = LlamaModel.from_dir(d, "cuda")
    layer = model.layers[0]
    assert cuda_feed.feeds_norm(layer.o, layer.gate_up, 5) and cuda_feed.feeds_norm(layer.down, layer.qkv, 3)
    calls = []
    real = cuda_feed.feed
    monkeypatch.setattr(cuda_feed, "feed", lambda *a, **k: calls.append(1) or real(*a, **k))

    def run(feed: bool, fused: bool) -> list[torch.Tensor]:
        monkeypatch.setattr(cuda_feed, "NORM_FEED", feed)
        monkeypatch.setattr(layers, "FUSED_NORM", fused)
        return prefill_then_decode(model)

    fed = run(True, True)
    assert len(calls) == 3 * 3  # per forward: o and down of layer 0, o of layer 1
    for other in (run(False, True), run(False, False)):
        for a, b in zip(fed, other):
            assert torch.equal(a, b)
