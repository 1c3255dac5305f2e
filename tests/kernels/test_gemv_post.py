"""RMSNorm applied at the GEMV's output (ops/cuda_post.py; csrc/quant/exl2_gemv_post.cuh, exl2_row_feed.cu).

Exact: the feeding GEMV's r is the plain GEMV's output plus the residual, rounded as add_rms_norm rounds it, and r
and its tile sums equal exl2_row_feed's over the plain output, bit for bit; the post-norm GEMV's rows of an M-row
launch equal the rows launched alone (the speculative verify's exactness), and its rope form equals it followed by
rope_kv_write. Against a float64 torch reference of the same operations (round(r * w') @ W, the row scale, the
bias): within 0.4% of the output's scale; against add_rms_norm then the GEMV, which rounds the normalized input
instead: within 1%. Tile sums against float64 sums: relative 1e-5. Shapes:
every bit width; hidden sizes of one tile, a partial last tile and 16 tiles; M = 1 .. 32; producers with split-K
and without (K = 64: one chunk), plain and gated, with bias; consumers of one and three parts; a norm weight above 1
(the 2^-e scale); the model forward (prefill, then decode steps) with the routing on, against it off.
"""

from __future__ import annotations

import pytest
import torch

from exl2_backend.errors import TensorShapeError
from tests.kernels.test_exl2_dequant import _to_cuda, make_qt
from tests.kernels.test_gemv_norm import _layout
from tests.kernels.tma_gemv import needs_tma_gemv, rand_half

pytestmark = pytest.mark.cuda


def _tile_sums(r: torch.Tensor) -> torch.Tensor:
    """float64 sums of squares of r [M, H] per 256-column tile -> [M, ceil(H / 256)]."""
    m, h = r.shape
    t = -(-h // 256)
    padded = torch.zeros(m, t * 256, dtype=torch.float64, device=r.device)
    padded[:, :h] = r.double()
    return (padded.view(m, t, 256) ** 2).sum(-1)


def _linear(k: int, n: int, bits: int, seed: int, bias: bool = False):
    from exl2_backend.ops import cuda_quant

    return cuda_quant.prepare_linear([_to_cuda(make_qt(_layout(k, bits), n, seed=seed, bias=bias))], "cuda")


# (producer K, hidden N, M)
FEED_CASES = [(512, 256, 1), (512, 576, 3), (64, 576, 5), (1024, 4096, 1), (1024, 4096, 5), (512, 576, 9),
              (256, 576, 32)]


@pytest.mark.parametrize("bits", [2, 3, 4, 5, 6, 8])
@pytest.mark.parametrize("k,n,m", FEED_CASES)
def test_feed_equals_the_gemv_then_row_feed(bits, k, n, m):
    from exl2_backend.ops import cuda_post

    needs_tma_gemv("the feed")
    producer = _linear(k, n, bits, seed=bits + k, bias=bits == 4)
    x, residual = rand_half((m, k), seed=m), rand_half((m, n), seed=m + 9, scale=4.0)
    x0, res0 = x.clone(), residual.clone()
    fed = cuda_post.feed(producer, x, residual)
    assert fed is not None, "the feed declined"
    r, ss, y = fed
    assert y is None
    h = producer.fused_kernel(x, "gemv")
    assert torch.equal(r, (h.float() + residual.float()).half())
    assert torch.equal(x, x0) and torch.equal(residual, res0)  # inputs untouched
    assert ss.shape == (m, cuda_post.tiles(n))
    torch.testing.assert_close(ss.double(), _tile_sums(r), rtol=1e-5, atol=1e-6)
    r2, ss2, _ = cuda_post.row_feed(h, residual)
    assert torch.equal(r2, r) and torch.equal(ss2, ss)
    r3, ss3, _ = cuda_post.row_feed(r, None)  # the first layer's form: r is h itself
    assert torch.equal(r3, r) and torch.equal(ss3, ss)


@pytest.mark.parametrize("m", [1, 5])
def test_gated_feed(m):
    """down-like: the producer's input silu(gate) * up."""
    from exl2_backend.ops import cuda_post

    needs_tma_gemv("the feed")
    inter, hidden = 640, 576
    down = _linear(inter, hidden, 3, seed=4)
    gate_up, residual = rand_half((m, 2 * inter), seed=5), rand_half((m, hidden), seed=6, scale=3.0)
    r, ss, _ = cuda_post.feed(down, gate_up, residual, gated=True)
    h = down.gated(gate_up)
    assert torch.equal(r, (h.float() + residual.float()).half())
    r2, ss2, _ = cuda_post.row_feed(h, residual)
    assert torch.equal(r2, r) and torch.equal(ss2, ss)


@pytest.mark.parametrize("m", [1, 3, 5, 9])
@pytest.mark.parametrize("producer_bits,hidden", [(4, 576), (3, 4096)])
def test_feed_scatters_the_consumer_input(producer_bits, hidden, m):
    """y = round(r * w') in each part's stored row order, padding rows zero; the consumer reading it gives the same
    bits as the consumer gathering from r. Consumer of three parts of mixed widths (padding rows in their runs)."""
    from exl2_backend.ops import cuda_post, cuda_quant

    needs_tma_gemv("the feed")
    producer = _linear(512, hidden, producer_bits, seed=hidden + m)
    parts = [_to_cuda(make_qt(_layout(hidden, b), nn, seed=b + m, key=f"p{b}")) for b, nn in ((4, 256), (3, 64),
                                                                                            (6, 64))]
    consumer = cuda_quant.prepare_linear(parts, "cuda")
    scaled = cuda_post.scaled_norm_weight(rand_half((hidden,), seed=2, scale=0.5) + 2)
    x, residual = rand_half((m, 512), seed=m), rand_half((m, hidden), seed=m + 1, scale=2.0)
    r, ss, y = cuda_post.feed(producer, x, residual, consumer=consumer, scaled=scaled)
    rows = cuda_post.stored_rows(consumer)
    assert y is not None and y.shape == (3, m, rows.ld)
    want = (r.float() * scaled[0].float()).half()  # [M, H]: the product of two halves is exact in fp32
    for q in range(3):
        assert torch.equal(y[q][:, rows.inv[q].long()], want), f"part {q}"
        pads = rows.pad[q, : int(rows.npad[q])].long()
        assert not y[q][:, pads].any(), f"part {q}'s padding rows"
    r2, ss2, _ = cuda_post.feed(producer, x, residual)
    assert torch.equal(r2, r) and torch.equal(ss2, ss)
    a = cuda_post.post_normed(consumer, r, ss, scaled, 1e-5, y=y)
    b = cuda_post.post_normed(consumer, r, ss, scaled, 1e-5)
    assert torch.equal(a, b)


def _reference(consumer, r: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    from exl2_backend import ops

    return consumer.fused_kernel(ops.rms_norm(r, w, eps).contiguous(), "gemv")


def _close_to_reference(y: torch.Tensor, want: torch.Tensor) -> None:
    scale = want.float().abs().max().item()
    torch.testing.assert_close(y.float(), want.float(), rtol=1e-2, atol=1e-2 * scale)


@pytest.mark.parametrize("bits", [2, 3, 4, 5, 6, 8])
@pytest.mark.parametrize("n,m", [(256, 1), (576, 3), (4096, 1), (4096, 5), (576, 9), (576, 32)])
def test_post_norm_gemv_rows_alone_and_reference(bits, n, m):
    from exl2_backend.ops import cuda_post

    needs_tma_gemv("the post norm")
    consumer = _linear(n, 320 if n < 4096 else 6144, bits, seed=bits * 7 + m, bias=bits == 5)
    r = rand_half((m, n), seed=m + n, scale=3.0)
    r2, ss, _ = cuda_post.row_feed(r, None)
    w = rand_half((n,), seed=n, scale=0.5) + (3 if bits == 6 else 1)  # above 1: w' = w / 2^e
    scaled = cuda_post.scaled_norm_weight(w)
    assert scaled[1] >= w.float().abs().max().item() and scaled[1] / 2 < max(1.0, w.float().abs().max().item())
    y = cuda_post.post_normed(consumer, r2, ss, scaled, 1e-5)
    _close_to_reference(y, _reference(consumer, r, w, 1e-5))
    launch = consumer.launch
    # the pure-torch reference of the same order of operations, in float64: round(r * w') @ W, then each row times
    # rsqrt(mean(r^2) + eps) * 2^e, then the bias
    part = launch.parts[0]
    wt = launch.dequant(0, 0, part.Np)[:, : part.N].double()  # [K, N], natural row order
    x = (r.float() * scaled[0].float()).half().double()
    inv = torch.rsqrt(r.double().pow(2).mean(-1, keepdim=True) + 1e-5) * scaled[1]
    want = (x @ wt) * inv + (0 if part.bias is None else part.bias.double())
    torch.testing.assert_close(y.double(), want, rtol=4e-3, atol=4e-3 * want.abs().max().item())
    if launch.gemv_splits(m) == launch.gemv_splits(1):
        for i in range(m):
            alone = cuda_post.post_normed(consumer, r2[i : i + 1].contiguous(), ss[i : i + 1].contiguous(), scaled,
                                          1e-5)
            assert torch.equal(y[i : i + 1], alone), f"row {i} of {m}"


@pytest.mark.parametrize("m", [1, 5])
def test_three_part_consumer_with_rope(m):
    """q/k/v-like consumer of three parts (one with bias): the rope form equals the GEMV followed by rope_kv_write."""
    from exl2_backend import ops
    from exl2_backend.ops import cuda_post, cuda_quant

    needs_tma_gemv("the post norm")
    hidden, heads, kv, d = 576, 4, 2, 64
    parts = [_to_cuda(make_qt(_layout(hidden, b), nn, seed=b, bias=b == 3, key=f"p{b}"))
             for b, nn in ((4, heads * d), (3, kv * d), (6, kv * d))]
    qkv = cuda_quant.prepare_linear(parts, "cuda")
    r, ss, _ = cuda_post.row_feed(rand_half((m, hidden), seed=3, scale=2.0), None)
    scaled = cuda_post.scaled_norm_weight(rand_half((hidden,), seed=7, scale=0.3) + 1)
    y = cuda_post.post_normed(qkv, r, ss, scaled, 1e-6)
    _close_to_reference(y, _reference(qkv, r, scaled[0].float().mul(scaled[1]).half(), 1e-6))
    pages, page = 4, 16
    positions = torch.arange(3, 3 + m, device="cuda")
    inv_freq = 1.0 / (10000 ** (torch.arange(0, d, 2, device="cuda", dtype=torch.float32) / d))
    slots = torch.arange(5, 5 + m, device="cuda")
    kc, vc = (torch.zeros(pages, page, kv, d, dtype=torch.float16, device="cuda") for _ in range(2))
    kc2, vc2 = kc.clone(), vc.clone()
    got = cuda_post.post_normed(qkv, r, ss, scaled, 1e-6, (positions, inv_freq, kc, vc, slots))
    assert got is not None
    want = y.clone()
    q, k, v = want.split(qkv.splits, dim=-1)
    ops.rope_kv_write(q.reshape(m, heads, d), k.reshape(m, kv, d), v.reshape(m, kv, d), positions, inv_freq, kc2,
                      vc2, slots)
    assert torch.equal(got[:, : heads * d], want[:, : heads * d])
    assert torch.equal(kc, kc2) and torch.equal(vc, vc2)


def test_routing_and_bad_inputs(monkeypatch):
    from exl2_backend.ops import cuda_post

    needs_tma_gemv("the post norm")
    hidden = 576
    o, gu = _linear(512, hidden, 4, seed=1), _linear(hidden, 640, 4, seed=2)
    monkeypatch.setattr(cuda_post, "POST_NORM", True)
    assert all(cuda_post.posts(gu, m) for m in range(1, 33)) and not cuda_post.posts(gu, 33)
    assert cuda_post.can_feed(o, 1)
    monkeypatch.setattr(cuda_post, "POST_NORM", False)
    assert not cuda_post.posts(gu, 1)

    launch, (ws, counters) = o.launch, o.workspace.buffers()
    x, residual = rand_half((2, 512), seed=3), rand_half((2, hidden), seed=4)
    with pytest.raises(TensorShapeError):  # residual of the wrong width
        torch.ops.exl2_backend.exl2_gemv_feed(x, residual[:, :-8], launch.parts[0].packed, launch.handle, ws,
                                              counters, 0, 0, None)
    with pytest.raises(TensorShapeError):  # input of the wrong width
        torch.ops.exl2_backend.exl2_gemv_feed(x[:, :-8], residual, launch.parts[0].packed, launch.handle, ws,
                                              counters, 0, 0, None)
    with pytest.raises(TensorShapeError):  # a hidden size that is not a multiple of 8
        cuda_post.row_feed(rand_half((2, 20), seed=1), None)
    r, ss, _ = cuda_post.feed(o, x, residual)
    w_scaled, mul = cuda_post.scaled_norm_weight(rand_half((hidden,), seed=5) + 1)
    g, (gws, gcounters) = gu.launch, gu.workspace.buffers()
    for bad_ss in (ss[:, :-1].contiguous(), ss.double(), ss[:1]):
        with pytest.raises(TensorShapeError):
            torch.ops.exl2_backend.exl2_gemv_post_norm(r, bad_ss, w_scaled, mul, 1e-5, g.parts[0].packed, g.handle,
                                                       gws, gcounters, None)
    with pytest.raises(TensorShapeError):  # a weight of the wrong length
        torch.ops.exl2_backend.exl2_gemv_post_norm(r, ss, w_scaled[:-8], mul, 1e-5, g.parts[0].packed, g.handle,
                                                   gws, gcounters, None)
    with pytest.raises(TensorShapeError):  # a pre-gathered input of the wrong shape
        torch.ops.exl2_backend.exl2_gemv_post_norm(r, ss, w_scaled, mul, 1e-5, g.parts[0].packed, g.handle, gws,
                                                   gcounters, torch.zeros(1, 2, 8, dtype=torch.float16, device="cuda"))
    with pytest.raises(TensorShapeError):  # a non-finite norm weight
        cuda_post.scaled_norm_weight(torch.full((hidden,), float("nan"), dtype=torch.float16, device="cuda"))


@pytest.mark.parametrize("hidden,heads,kv", [(256, 4, 2), (576, 9, 3)])
def test_model_forward_with_the_norm_at_the_output(tmp_path, monkeypatch, hidden, heads, kv):
    """LlamaModel: a 5-token prefill, then decode steps of 1 and 3 sequences (tests/helpers/forward_steps.py); with
    the routing on, every layer's gate/up and q/k/v take it at 1 and 3 rows, and the logits stay within 2% of the
    routing-off model's scale."""
    from exl2_backend.model.llama import LlamaModel
    from exl2_backend.ops import cuda_post
    from tests.helpers.forward_steps import prefill_then_decode
    from tests.helpers.synth import tiny_config_dict, write_tiny_exl2_model

    needs_tma_gemv("the post norm")
    cfg = tiny_config_dict(hidden_size=hidden, intermediate_size=2 * hidden, num_attention_heads=heads,
                           num_key_value_heads=kv)
    d = write_tiny_exl2_model(tmp_path / "m", cfg, seed=5)
    off = prefill_then_decode(LlamaModel.from_dir(d, "cuda"))
    monkeypatch.setattr(cuda_post, "POST_NORM", True)
    model = LlamaModel.from_dir(d, "cuda")
    layer = model.layers[0]
    assert layer.input_norm_scaled is not None and cuda_post.posts(layer.gate_up, 3)
    calls = []
    real = cuda_post.post_normed
    monkeypatch.setattr(cuda_post, "post_normed", lambda *a, **k: calls.append(1) or real(*a, **k))
    on = prefill_then_decode(model)
    assert calls  # the decode steps ran the post-norm GEMVs
    for a, b in zip(on, off):
        scale = b.float().abs().max().item()
        torch.testing.assert_close(a.float(), b.float(), rtol=2e-2, atol=2e-2 * scale)
