"""RMSNorm fused into the TMA GEMV's input (CudaLinearOp.add_normed, csrc/quant/exl2_gemv_norm.cuh), and for rows
past one pass the norm writing the GEMV's stored row order (csrc/quant/exl2_gemv_norm_pregather.cu).

Exact: the fused kernel repeats add_rms_norm's arithmetic step for step (threads per row, vector order, fma chain,
warp sums, roundings), so its GEMV input, its output and the residual stream it writes are bit-identical to
add_rms_norm followed by the plain GEMV. Shapes: every bit width in a mixed layout, hidden sizes with one, two and
several rows per pass of the 256 compute threads (576, 1056, 4096, 8192), M up to the shared-memory cap, with and
without a residual, three fused parts with bias; the model forward with the fusion on and off. The pre-gathering
norm keeps the same arithmetic (gv_norm_rows, one row per block) and is held to the same bit-identity.
"""

from __future__ import annotations

import pytest
import torch

from exl2_backend.errors import TensorShapeError
from tests.kernels.test_exl2_dequant import _to_cuda, make_qt
from tests.kernels.tma_gemv import needs_tma_gemv, rand_half

pytestmark = pytest.mark.cuda


def _layout(k: int, bits: int) -> list[tuple[int, int]]:
    """A mixed layout of K rows: an 8-bit group, groups of 128 at `bits`, the rest at `bits`."""
    full = (k - 32) // 128
    rest = k - 32 - 128 * full
    return [(8, 32)] + [(bits, 128)] * full + ([(bits, rest)] if rest else [])


def _check(op, h, residual, w, eps=1e-5, pregather=False):
    from exl2_backend import ops

    h0 = h.clone()
    r0 = None if residual is None else residual.clone()
    if residual is None:
        x, want_res = ops.rms_norm(h, w, eps), h
    else:
        x, want_res = ops.add_rms_norm(h.clone(), residual.clone(), w, eps)
    want = op.fused_kernel(x.contiguous(), "gemv")
    got = op.add_normed(h, residual, w, eps, always=True, pregather=pregather)
    assert got is not None, "the fused path declined"
    y, res = got
    assert torch.equal(y, want)
    assert torch.equal(res, want_res)
    assert torch.equal(h, h0) and (residual is None or torch.equal(residual, r0))  # inputs untouched


# (k, m, pregather): False is the norm inside the GEMV (any M it can take, `always`), True the norm writing the
# stored row order (one block per row and part) with the GEMV copying its rows.
NORM_CASES = [(576, 1, False), (576, 5, False), (576, 32, False), (1056, 3, False), (4096, 1, False),
              (4096, 5, False), (8192, 2, False), (576, 3, True), (576, 32, True), (1056, 17, True), (4096, 3, True),
              (4096, 5, True), (4096, 8, True), (8192, 5, True)]


@pytest.mark.parametrize("bits", [2, 3, 4, 5, 6, 8])
@pytest.mark.parametrize("k,m,pregather", NORM_CASES)
def test_norm_fused_gemv_equals_add_rms_norm_then_gemv(bits, k, m, pregather):
    from exl2_backend.ops import cuda_quant

    needs_tma_gemv("the norm fused into the GEMV")
    qt = _to_cuda(make_qt(_layout(k, bits), 333, seed=bits * 11 + m, bias=bits == 4))
    op = cuda_quant.prepare_linear([qt], "cuda")
    w = rand_half((k,), seed=k, scale=0.3) + 1
    h, residual = rand_half((m, k), seed=m), rand_half((m, k), seed=m + 50, scale=4.0)
    _check(op, h, residual, w, pregather=pregather)
    _check(op, h, None, w, pregather=pregather)


@pytest.mark.parametrize("k,rows,last_n,pregather", [(576, 4, 192, False), (1056, 6, 200, True)])
def test_norm_fused_three_parts_and_strided_rows(k, rows, last_n, pregather):
    """q/k/v-like: three parts of one K (one with bias; with the pre-gathering norm, of different padded lengths),
    h a row slice of a wider buffer (the head's last-token rows), the residual stream written to a fresh tensor."""
    from exl2_backend.ops import cuda_quant

    needs_tma_gemv("the norm fused into the GEMV")
    parts = [_to_cuda(make_qt(_layout(k, b), n, seed=b, bias=b == 3, key=f"p{b}")) for b, n in ((4, 576), (3, 192),
                                                                                                 (6, last_n))]
    op = cuda_quant.prepare_linear(parts, "cuda")
    w = rand_half((k,), seed=1, scale=0.3) + 1
    wide = rand_half((rows, 2 * k), seed=2)
    h = wide[:, :k]  # row stride 2K
    _check(op, h, rand_half((rows, k), seed=3), w, pregather=pregather)


def test_norm_fused_declines_what_it_cannot_take(monkeypatch):
    from exl2_backend.ops import cuda_quant

    needs_tma_gemv("the norm fused into the GEMV")
    k = 576
    op = cuda_quant.prepare_linear([_to_cuda(make_qt(_layout(k, 4), 256, seed=5))], "cuda")
    w = rand_half((k,), seed=1) + 1
    h, r = rand_half((6, k), seed=2), rand_half((6, k), seed=3)
    assert cuda_quant.norm_row_threads(k) == 32 and op.launch.takes_norm(8) and not op.launch.takes_norm(9)
    monkeypatch.setattr(cuda_quant, "NORM_SMEM_BYTES", 5 * k * 2)  # 6 rows no longer fit the norm-fused GEMV
    assert op.add_normed(h, r, w, 1e-5, always=True) is None and op.add_normed(h, r, w, 1e-5, pregather=False) is None
    assert op.add_normed(h, r, w, 1e-5) is not None  # routing: the pre-gathering norm
    monkeypatch.setattr(cuda_quant, "NORM_PREGATHER", False)
    assert op.add_normed(h, r, w, 1e-5) is None  # the caller's two ops
    assert op.add_normed(h[:5], r[:5], w, 1e-5) is not None
    unaligned = rand_half((1, k + 1), seed=4)[:, 1:]  # rows start 2 bytes past a 16-byte boundary
    assert op.add_normed(unaligned, None, w, 1e-5) is None
    assert op.add_normed(h[:1], r[:1], w.float(), 1e-5) is None  # an fp32 norm weight
    launch = op.launch
    ws, counters = op.workspace.buffers()
    with pytest.raises(TensorShapeError):  # the op itself: wrong width, wrong weight length
        torch.ops.exl2_backend.exl2_gemv_add_norm(rand_half((1, k + 8), 0), None, w, 1e-5, launch.parts[0].packed,
                                                  launch.handle, ws, counters)
    with pytest.raises(TensorShapeError):
        torch.ops.exl2_backend.exl2_gemv_add_norm(h[:1], r[:1], w[:-8], 1e-5, launch.parts[0].packed,
                                                  launch.handle, ws, counters)


def test_norm_routing_takes_one_pass_of_rows(monkeypatch):
    """Routing fuses the norm into the GEMV only where the M rows fit one pass (K = 4096: 128 threads per row, two
    rows); more rows take the pre-gathering norm (NORM_PREGATHER), or the caller's two ops without it."""
    from exl2_backend.ops import cuda_quant

    needs_tma_gemv("the norm fused into the GEMV")
    op = cuda_quant.prepare_linear([_to_cuda(make_qt(_layout(4096, 4), 64, seed=9))], "cuda")
    assert [op.launch.takes_norm(m) for m in (1, 2, 3)] == [True, True, False]
    assert op.launch.can_norm(5) and not op.launch.can_norm(6)  # 40 KB of normalized rows
    w = rand_half((4096,), seed=1) + 1
    h, r = rand_half((3, 4096), seed=2), rand_half((3, 4096), seed=3)
    calls = []
    real = op.launch.gemv_add_norm
    monkeypatch.setattr(op.launch, "gemv_add_norm", lambda *a: calls.append(a[-1]) or real(*a))
    assert op.add_normed(h, r, w, 1e-5) is not None and calls == [True]  # three rows: the pre-gathering norm
    assert op.add_normed(h[:2], r[:2], w, 1e-5) is not None and calls == [True, False]  # two: the norm-fused GEMV
    monkeypatch.setattr(cuda_quant, "NORM_PREGATHER", False)
    assert op.add_normed(h, r, w, 1e-5) is None


@pytest.mark.parametrize("fused_rows", [8, 2])
def test_model_forward_bit_identical_with_and_without_the_fused_norm(tmp_path, monkeypatch, fused_rows):
    """LlamaModel: a 5-token prefill, then decode steps of 1 and 3 sequences (tests/helpers/forward_steps.py);
    logits equal bit for bit with layers.FUSED_NORM on and off (the head's final norm included). fused_rows 2: the
    norm-fused GEMV takes at most two rows, so the prefill and the 3-sequence step run the pre-gathering norm."""
    from exl2_backend.model import layers
    from exl2_backend.model.llama import LlamaModel
    from exl2_backend.ops import cuda_quant
    from tests.helpers.forward_steps import prefill_then_decode
    from tests.helpers.synth import tiny_config_dict, write_tiny_exl2_model

    needs_tma_gemv("the norm fused into the GEMV")
    cfg = tiny_config_dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2)
    d = write_tiny_exl2_model(tmp_path / "m", cfg, seed=3)
    monkeypatch.setattr(cuda_quant, "NORM_SMEM_BYTES", fused_rows * 256 * 2)
    model = LlamaModel.from_dir(d, "cuda")
    assert model.layers[0].qkv.launch.takes_norm(1) and model.lm_head.launch.takes_norm(3) == (fused_rows >= 3)

    def run(on: bool) -> list[torch.Tensor]:
        monkeypatch.setattr(layers, "FUSED_NORM", on)
        return prefill_then_decode(model)

    for a, b in zip(run(True), run(False)):
        assert torch.equal(a, b)
