"""The norm handoff between two TMA GEMVs (ops/cuda_handoff.py, csrc/quant/exl2_gemv_handoff.cuh).

Against the pure-torch reference (ops/reference_handoff.py). Out: the producing GEMV's output y is bit-identical
to the plain GEMV's, the stream r = round(y + residual) to handoff_out's (add_rms_norm's residual output), and the
per-256-column sums of r^2 match its sums to fp32 rounding (rtol 1e-5). In: the consuming GEMV equals the plain GEMV
of handoff_in's normalized rows from the same partial sums, within a relative L2 error of 2e-3: the kernel's sum
over the partials runs in another order, so a normalized input may land one fp16 ulp away. Shapes: every bit width
in a mixed layout, hidden sizes with a partial last column block (576, 1056) and whole ones (4096, 8192), M from 1
to 32, gated (silu_mul) producers, q/k/v consumers with rope and the KV-cache write, the two chained, a CUDA graph,
bad inputs, and the model forward with the handoff on.
"""

from __future__ import annotations

import pytest
import torch

from exl2_backend.errors import KernelUnavailableError, TensorShapeError
from exl2_backend.ops.reference_handoff import block_sums, handoff_in, handoff_out
from tests.kernels.test_exl2_dequant import _to_cuda, make_qt
from tests.kernels.test_gemv_norm import _layout, _needs_tma, _rand

pytestmark = pytest.mark.cuda
EPS = 1e-5


def _op(k: int, n: int, bits: int, seed: int, bias: bool = False):
    from exl2_backend.ops import cuda_quant

    return cuda_quant.prepare_linear([_to_cuda(make_qt(_layout(k, bits), n, seed=seed, bias=bias))], "cuda")


def _close(got: torch.Tensor, want: torch.Tensor, rel: float = 2e-3) -> None:
    err = (got.float() - want.float()).norm() / want.float().norm().clamp_min(1e-6)
    assert torch.isfinite(got).all() and err < rel, f"relative L2 error {err:.2e}"


@pytest.mark.parametrize("bits", [2, 3, 4, 5, 6, 8])
@pytest.mark.parametrize("k,n,m", [(512, 576, 1), (576, 1056, 5), (1056, 4096, 2), (4096, 4096, 5), (256, 8192, 9),
                                   (512, 576, 32)])
@pytest.mark.parametrize("gated", [False, True])
def test_handoff_out_writes_the_stream_and_its_sums(bits, k, n, m, gated):
    from exl2_backend.ops.cuda_handoff import residual_handoff

    _needs_tma()
    op = _op(k, n, bits, seed=bits * 7 + m, bias=bits == 4)
    x = _rand((m, 2 * k if gated else k), seed=m)
    residual = _rand((m, n), seed=m + 9, scale=4.0)
    x0, r0 = x.clone(), residual.clone()
    got = residual_handoff(op, x, residual, gated=gated)
    assert got is not None, "the handoff declined"
    y, r, sq = got
    want = op.gated(x) if gated else op.fused_kernel(x, "gemv")
    assert torch.equal(y, want)
    want_r, want_sq = handoff_out(want, residual)
    assert torch.equal(r, want_r)
    torch.testing.assert_close(sq, want_sq, rtol=1e-5, atol=1e-6)
    assert torch.equal(x, x0) and torch.equal(residual, r0)


@pytest.mark.parametrize("bits", [2, 3, 4, 5, 6, 8])
@pytest.mark.parametrize("k,m", [(576, 1), (576, 32), (1056, 5), (4096, 1), (4096, 5), (4096, 17), (8192, 3)])
def test_handoff_in_normalizes_its_rows(bits, k, m):
    from exl2_backend.ops.cuda_handoff import normed_handoff

    _needs_tma()
    op = _op(k, 333, bits, seed=bits * 5 + m, bias=bits == 6)
    r = _rand((m, k), seed=m + 1, scale=4.0)
    w = _rand((k,), seed=k, scale=0.3) + 1
    sq = block_sums(r)
    y = normed_handoff(op, r, sq, w, EPS)
    assert y is not None, "the handoff declined"
    _close(y, op.fused_kernel(handoff_in(r, sq, w, EPS), "gemv"))


@pytest.mark.parametrize("m", [1, 3, 5, 17])
def test_handoff_in_with_rope_and_the_kv_write(m):
    """The q/k/v consumer with rope and the fp16 KV-cache write after it, against the norm-fused GEMV with the same
    fusions (add_normed_rope_kv): the projection, the rotated q and the cache rows within the tolerance."""
    from exl2_backend.ops.cuda_handoff import normed_handoff
    from tests.kernels.test_gemv_rope_kv import _qkv, _step

    _needs_tma()
    hq, hk, d, k = 8, 2, 128, 1024
    op = _qkv(k, hq, hk, d, "5:0.1@128 4:0.9@128", seed=m)
    r = _rand((m, k), seed=m + 3, scale=4.0)
    w = _rand((k,), seed=7, scale=0.3) + 1
    positions, inv_freq, kc, vc, slots = _step(m, hk, d, seed=m)
    kc1, vc1, kc2, vc2 = kc.clone(), vc.clone(), kc.clone(), vc.clone()
    got = normed_handoff(op, r, block_sums(r), w, EPS, (positions, inv_freq, kc1, vc1, slots))
    want = op.add_normed_rope_kv(r, None, w, EPS, positions, inv_freq, kc2, vc2, slots)
    assert got is not None and want is not None
    _close(got, want[0])
    _close(kc1, kc2)
    _close(vc1, vc2)
    assert torch.equal(kc1 != kc, kc2 != kc)  # the same cache rows written (the skipped slots untouched)


@pytest.mark.parametrize("m", [1, 5])
def test_handoff_from_producer_to_consumer_and_in_a_graph(m):
    """o_proj-like producer -> gate/up-like consumer against o_proj then the norm-fused GEMV (add_normed): the stream
    exactly, the consumer's output within the tolerance; replayed from a CUDA graph, bit for bit the eager run."""
    from exl2_backend.ops.cuda_handoff import normed_handoff, residual_handoff

    _needs_tma()
    hidden = 1056
    o, up = _op(512, hidden, 4, seed=1), _op(hidden, 768, 3, seed=2)
    attn, residual = _rand((m, 512), seed=3), _rand((m, hidden), seed=4, scale=4.0)
    w = _rand((hidden,), seed=5, scale=0.3) + 1

    def run():
        _, r, sq = residual_handoff(o, attn, residual)
        return r, normed_handoff(up, r, sq, w, EPS)

    r, y = run()
    want_y, want_r = up.add_normed(o.fused_kernel(attn, "gemv"), residual, w, EPS, always=True)
    assert torch.equal(r, want_r)
    _close(y, want_y)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        gr, gy = run()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(gr, r) and torch.equal(gy, y)


def test_handoff_refuses_what_it_cannot_take():
    from exl2_backend.ops import cuda_handoff, cuda_quant

    _needs_tma()
    op = _op(576, 1056, 4, seed=9)
    x, residual = _rand((2, 576), seed=1), _rand((2, 1056), seed=2)
    packed, handle = op.launch.parts[0].packed, op.launch.handle
    ws, counters = op.workspace.buffers()
    with pytest.raises(TensorShapeError, match="residual"):
        torch.ops.exl2_backend.exl2_gemv_handoff_out(x, residual[:, :1024], packed, handle, ws, counters, False)
    r, w = _rand((2, 576), seed=3), _rand((576,), seed=4) + 1
    sq = block_sums(r)
    with pytest.raises(TensorShapeError, match="sq"):
        torch.ops.exl2_backend.exl2_gemv_handoff_in(r, sq[:, :2], w, EPS, packed, handle, ws, counters)
    with pytest.raises(TensorShapeError, match="sq"):
        torch.ops.exl2_backend.exl2_gemv_handoff_in(r, sq.half(), w, EPS, packed, handle, ws, counters)
    with pytest.raises(ValueError, match="eps"):
        torch.ops.exl2_backend.exl2_gemv_handoff_in(r, sq, w, 0.0, packed, handle, ws, counters)
    three = cuda_quant.prepare_linear([_to_cuda(make_qt(_layout(576, 4), 64, seed=s)) for s in (1, 2, 3)], "cuda")
    assert cuda_handoff.residual_handoff(three, x, _rand((2, 192), seed=5)) is None  # a producer has one part
    assert cuda_handoff.residual_handoff(op, _rand((33, 576), seed=6), _rand((33, 1056), seed=7)) is None  # M > 32
    args = cuda_handoff.np.array([3, 0, 0, 0, 0, 0, 0, 0], dtype=cuda_handoff.np.int64)  # no such kind
    with pytest.raises(KernelUnavailableError, match="handoff"):
        cuda_handoff._gemv(op.launch, x, 0, ws, counters, args)


@pytest.mark.parametrize("mode", ["all", "verify"])
def test_model_forward_with_the_norm_handoff(tmp_path, monkeypatch, mode):
    """LlamaModel (tests/helpers/forward_steps.py: a 5-token prefill, decode steps of 1 and 3 sequences): logits with
    layers.NORM_HANDOFF on within 2e-3 (relative L2) of the run without it; "all" hands off in every decode step,
    "verify" only where the norm would not fuse in one pass (here the prefill and the 3-sequence step)."""
    from exl2_backend.model import layers
    from exl2_backend.model.llama import LlamaModel
    from exl2_backend.ops import cuda_handoff, cuda_quant
    from tests.helpers.forward_steps import prefill_then_decode
    from tests.helpers.synth import tiny_config_dict, write_tiny_exl2_model

    _needs_tma()
    cfg = tiny_config_dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2)
    monkeypatch.setattr(cuda_quant, "NORM_SMEM_BYTES", 2 * 256 * 2)  # the fused norm takes two rows
    model = LlamaModel.from_dir(write_tiny_exl2_model(tmp_path / "m", cfg, seed=5), "cuda")
    rows = []
    real = cuda_handoff.normed_handoff

    def counting(op, r, *args, **kwargs):
        rows.append(r.shape[0])
        return real(op, r, *args, **kwargs)

    monkeypatch.setattr(cuda_handoff, "normed_handoff", counting)

    def run(on: str) -> list[torch.Tensor]:
        monkeypatch.setattr(layers, "NORM_HANDOFF", on)
        return prefill_then_decode(model)

    for got, want in zip(run(mode), run("0")):
        _close(got, want)
    assert set(rows) == ({5, 1, 3} if mode == "all" else {5, 3})  # the 5-token prefill runs the GEMV too
