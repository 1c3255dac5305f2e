"""The next GEMV's input norm at the end of a GEMV launch (CudaLinearOp.norm_tail, csrc/quant/exl2_gemv_norm_tail.cuh).

Exact: the norm's workers run what norm_pregather_kernel's blocks run (gv_norm_row, then the part's stored rows), so
the residual stream, the next linear's input and its output are bit-identical to the GEMV followed by
exl2_add_norm_pregather and the pre-gathered GEMV (CudaLinearOp.add_normed with pregather=True). Shapes: every bit
width in a mixed layout, M = 1..16 (one and two token tiles), a plain and a gated (silu(gate) * up) producer, one
and three next parts of different padded lengths, hidden sizes with one and several rows per norm pass; repeated
launches and CUDA-graph replays (the counter re-arms itself), the rope-fused q/k/v consumer, the two-launch route
when the grid is not resident all at once, bad inputs, and the model forward with the tail on and off.
"""

from __future__ import annotations

import pytest
import torch

from exl2_backend.errors import TensorShapeError
from tests.kernels.test_exl2_dequant import _to_cuda, make_qt
from tests.kernels.test_gemv_norm import _layout, _rand

pytestmark = pytest.mark.cuda


def _needs_tma():
    from exl2_backend.ops import cuda_quant

    if cuda_quant.gemv_row_cap(torch.device("cuda")) < 32 or cuda_quant.GEMV_MINB != 0:
        pytest.skip("the norm tail runs on the TMA GEMV only (sm_90+)")


def _producer(k_in: int, hidden: int, bits: int, seed: int, bias: bool = False):
    from exl2_backend.ops import cuda_quant

    return cuda_quant.prepare_linear([_to_cuda(make_qt(_layout(k_in, bits), hidden, seed=seed, bias=bias))], "cuda")


def _consumer(hidden: int, widths: list[tuple[int, int]], seed: int):
    """Parts of (bits, N) over the hidden size; the 3-bit parts store whole 3-bit fields, so Kpad differs."""
    from exl2_backend.ops import cuda_quant

    parts = [_to_cuda(make_qt(_layout(hidden, b), n, seed=seed + i, key=f"c{i}")) for i, (b, n) in enumerate(widths)]
    return cuda_quant.prepare_linear(parts, "cuda")


def _tail(prod, x, residual, w, cons, gated: bool, eps: float = 1e-5):
    """The op itself (routing would leave rows that fit the norm-fused GEMV to it)."""
    ws, counters = prod.workspace.buffers()
    lp, lc = prod.launch, cons.launch
    return torch.ops.exl2_backend.exl2_gemv_norm_tail(x, lp.parts[0].packed, lp.handle, ws, counters,
                                                      prod.workspace.tail_counter, lp.K if gated else 0, residual, w,
                                                      eps, lc.parts[0].packed, lc.handle)


def _apart(prod, x, residual, w, cons, gated: bool, eps: float = 1e-5):
    """The same through three launches: the GEMV, exl2_add_norm_pregather, the pre-gathered GEMV."""
    h = prod.gated(x) if gated else prod.fused_kernel(x, "gemv")
    got = cons.add_normed(h, residual, w, eps, pregather=True)
    assert got is not None, "the pre-gathering norm declined"
    return got  # (y, residual stream)


def _check(prod, cons, x, residual, w, gated: bool, repeats: int = 2):
    x0, r0 = x.clone(), residual.clone()
    y_want, res_want = _apart(prod, x, residual, w, cons, gated)
    for _ in range(repeats):  # the counter is left at zero for the next launch
        res, pre = _tail(prod, x, residual, w, cons, gated)
        y = cons.pregathered(res, pre)
        assert torch.equal(res, res_want)
        assert torch.equal(y, y_want)
    assert torch.equal(x, x0) and torch.equal(residual, r0)  # inputs untouched
    assert int(prod.workspace.tail_counter[0]) == 0


@pytest.mark.parametrize("bits", [2, 3, 4, 5, 6, 8])
@pytest.mark.parametrize("m", [1, 3, 5, 8, 9, 16])
def test_norm_tail_equals_gemv_then_pregathering_norm(bits, m):
    _needs_tma()
    k_in, hidden = 1056, 4096
    prod = _producer(k_in, hidden, bits, seed=bits * 7 + m, bias=bits == 4)
    cons = _consumer(hidden, [(4, 520), (3, 256)], seed=m)
    x, r = _rand((m, k_in), seed=m), _rand((m, hidden), seed=m + 50, scale=4.0)
    w = _rand((hidden,), seed=3, scale=0.3) + 1
    _check(prod, cons, x, r, w, gated=False)


@pytest.mark.parametrize("hidden,m", [(576, 3), (576, 16), (1056, 5), (4096, 5), (8192, 4)])
def test_norm_tail_gated_producer_three_parts(hidden, m):
    """down_proj -> the next q/k/v: a gated input [M, 2K], three next parts (one of 3-bit fields, one 8-bit)."""
    _needs_tma()
    k_in = 704
    prod = _producer(k_in, hidden, 4, seed=hidden + m)
    cons = _consumer(hidden, [(4, 512), (3, 128), (8, 136)], seed=hidden)
    x = _rand((m, 2 * k_in), seed=m)
    r, w = _rand((m, hidden), seed=m + 1, scale=4.0), _rand((hidden,), seed=4, scale=0.3) + 1
    _check(prod, cons, x, r, w, gated=True)


def test_norm_tail_when_the_grid_is_not_resident_at_once(monkeypatch):
    """Eight planned blocks per SM: the grid exceeds one wave, so exl2_gemv_norm_tail runs the GEMV and the
    pre-gathering norm as two launches; the same bits."""
    from exl2_backend.ops import cuda_quant

    _needs_tma()
    monkeypatch.setattr(cuda_quant, "GEMV_BLOCKS_PER_SM", 8.0)
    k_in, hidden, m = 4096, 1024, 5
    prod = _producer(k_in, hidden, 4, seed=1)
    prod.workspace.reserve(prod.launch.gemv_plan(m).ws_numel)
    assert prod.launch.gemv_splits(m)[1] > 2 * prod.launch.sms
    cons = _consumer(hidden, [(4, 256)], seed=2)
    x, r, w = _rand((m, k_in), 1), _rand((m, hidden), 2), _rand((hidden,), 3, 0.3) + 1
    _check(prod, cons, x, r, w, gated=False)


def test_norm_tail_in_a_cuda_graph():
    """Captured once (tail and pre-gathered GEMV); replays follow new inputs written into the static buffers."""
    _needs_tma()
    k_in, hidden, m = 1024, 2048, 5
    prod = _producer(k_in, hidden, 4, seed=5)
    cons = _consumer(hidden, [(4, 1024), (3, 512)], seed=6)
    w = _rand((hidden,), 9, 0.3) + 1
    x, r = _rand((m, k_in), 1), _rand((m, hidden), 2)
    _tail(prod, x, r, w, cons, False)  # warm-up outside the graph
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        res, pre = _tail(prod, x, r, w, cons, False)
        y = cons.pregathered(res, pre)
    for seed in (11, 12, 13):
        x.copy_(_rand((m, k_in), seed))
        r.copy_(_rand((m, hidden), seed + 1))
        graph.replay()
        torch.cuda.synchronize()
        y_want, res_want = _apart(prod, x, r, w, cons, False)
        assert torch.equal(res, res_want) and torch.equal(y, y_want)
    assert int(prod.workspace.tail_counter[0]) == 0


def test_norm_tail_before_the_rope_fused_qkv():
    """The next layer's q/k/v from the tail's stored-order input with rope and the KV-cache write in its launch:
    bit-identical to add_normed_rope_kv with the pre-gathering norm."""
    from tests.kernels.test_gemv_rope_kv import _qkv, _step

    _needs_tma()
    hq, hk, d, hidden, m = 8, 2, 128, 1024, 5
    prod = _producer(512, hidden, 4, seed=8)
    cons = _qkv(hidden, hq, hk, d, "5:0.1@128 4:0.9@128", seed=9)
    x = _rand((m, 2 * 512), 1)
    r, w = _rand((m, hidden), 2), _rand((hidden,), 3, 0.2) + 1
    positions, inv_freq, kc, vc, slots = _step(m, hk, d, seed=4)
    kc1, vc1, kc2, vc2 = kc.clone(), vc.clone(), kc.clone(), vc.clone()
    h = prod.gated(x)
    want = cons.add_normed_rope_kv(h, r, w, 1e-5, positions, inv_freq, kc2, vc2, slots, pregather=True)
    res, pre = _tail(prod, x, r, w, cons, True)
    y = cons.pregathered_rope_kv(res, pre, positions, inv_freq, kc1, vc1, slots)
    assert y is not None
    for a, b in zip((y, res, kc1, vc1), (want[0], want[1], kc2, vc2)):
        assert torch.equal(a, b)


def test_norm_tail_routing_and_bad_inputs(monkeypatch):
    from exl2_backend.ops import cuda_quant

    _needs_tma()
    hidden = 4096
    prod = _producer(512, hidden, 4, seed=1)
    cons = _consumer(hidden, [(4, 256)], seed=2)
    w = _rand((hidden,), 3, 0.3) + 1
    x, r = _rand((17, 512), 4), _rand((17, hidden), 5)
    # routing: the tail where the pre-gathering norm would run (M >= 3 at 4096), up to 16 rows
    assert prod.norm_tail(x[:2], r[:2], w, 1e-5, cons) is None  # two rows: the norm-fused GEMV's
    assert prod.norm_tail(x[:3], r[:3], w, 1e-5, cons) is not None
    assert prod.norm_tail(x, r, w, 1e-5, cons) is None  # 17 rows
    assert prod.norm_tail(x[:3], r[:3], w.float(), 1e-5, cons) is None
    assert prod.norm_tail(x[:3], r[:3], w, 1e-5, cons, gated=True) is None  # x is not [M, 2K]
    monkeypatch.setattr(cuda_quant, "NORM_TAIL", False)
    assert prod.norm_tail(x[:3], r[:3], w, 1e-5, cons) is None
    monkeypatch.setattr(cuda_quant, "NORM_TAIL", True)
    other = _consumer(1024, [(4, 256)], seed=3)  # takes K = 1024, the producer writes 4096
    with pytest.raises(TensorShapeError):
        _tail(prod, x[:3], r[:3], w, other, False)
    with pytest.raises(TensorShapeError):  # 17 rows
        _tail(prod, x, r, w, cons, False)
    with pytest.raises(TensorShapeError):  # residual of the wrong width
        _tail(prod, x[:3], r[:3, :1024], w, cons, False)
    with pytest.raises(TensorShapeError):  # norm weight of the wrong length
        _tail(prod, x[:3], r[:3], w[:-8], cons, False)
    with pytest.raises(TensorShapeError):  # gated, but x holds no up half
        _tail(prod, x[:3], r[:3], w, cons, True)
    with pytest.raises(TensorShapeError):
        _tail(prod, x[:3], r[:3], w, cons, False, eps=0.0)
    res, pre = _tail(prod, x[:3], r[:3], w, cons, False)
    with pytest.raises(TensorShapeError):  # a buffer of the wrong size
        cons.pregathered(res, pre[:-8])
    assert int(prod.workspace.tail_counter[0]) == 0


def test_model_forward_bit_identical_with_and_without_the_norm_tail(tmp_path, monkeypatch):
    """LlamaModel: a 5-token prefill, then decode steps of 1 and 3 sequences; the norm-fused GEMV takes at most two
    rows, so the prefill and the 3-sequence step run the pre-gathering norms, at the ends of o_proj and
    down_proj with the tail (counted) and as launches of their own without it. Logits equal bit for bit."""
    from exl2_backend.model import layers
    from exl2_backend.model.llama import LlamaModel
    from exl2_backend.ops import cuda_quant
    from tests.helpers.forward_steps import prefill_then_decode
    from tests.helpers.synth import tiny_config_dict, write_tiny_exl2_model

    _needs_tma()
    cfg = tiny_config_dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2)
    d = write_tiny_exl2_model(tmp_path / "m", cfg, seed=3)
    monkeypatch.setattr(cuda_quant, "NORM_SMEM_BYTES", 2 * 256 * 2)
    model = LlamaModel.from_dir(d, "cuda")
    calls = []
    real = cuda_quant._Launch.gemv_norm_tail
    monkeypatch.setattr(cuda_quant._Launch, "gemv_norm_tail", lambda self, *a: calls.append(a[0].shape[0]) or
                        real(self, *a))

    def run(on: bool) -> list[torch.Tensor]:
        monkeypatch.setattr(cuda_quant, "NORM_TAIL", on)
        return prefill_then_decode(model)

    with_tail = run(True)
    assert calls and min(calls) >= 3
    n = len(calls)
    without = run(False)
    assert len(calls) == n
    assert len(with_tail) == len(without)
    for a, b in zip(with_tail, without):
        assert torch.equal(a, b)
    assert layers.FUSED_NORM
