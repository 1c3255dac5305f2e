"""CUDA layer kernels (csrc/layers/) against the reference ops, on the GPU.

Tolerances (tests/helpers/tolerances.py): elementwise outputs use `assert_close` with the fp16/bf16 table
(atol 1e-3 / rtol 2e-3 for fp16: a 1-ulp difference passes, e.g. where cos/sin or exp round differently);
copies and residual sums (x + residual rounded once, same as the reference) are exact.
"""

from __future__ import annotations

import pytest
import torch

from exl2_backend.errors import InvalidRequestError
from exl2_backend.ops import reference
from tests.helpers.tolerances import assert_close, assert_exact

pytestmark = pytest.mark.cuda

DEV = "cuda"


def cl():
    from exl2_backend.ops import cuda_layers

    return cuda_layers


def poison(t: torch.Tensor) -> torch.Tensor:
    return t.fill_(float("nan")) if t.is_floating_point() else t.fill_(-7)


# --- rms_norm / add_rms_norm -------------------------------------------------------------------------


@pytest.mark.parametrize("hidden", [576, 577, 2048, 4096, 8192, 40000])
@pytest.mark.parametrize("tokens", [1, 7, 33])
def test_rms_norm(hidden, tokens):
    x = torch.randn(tokens, hidden, device=DEV).half() * 3
    w = torch.randn(hidden, device=DEV).half()
    out = cl().rms_norm(x, w, 1e-5)
    assert_close(out, reference.rms_norm(x, w, 1e-5), msg=f"rms_norm H={hidden} T={tokens}")


@pytest.mark.parametrize("dtype,wdtype", [(torch.bfloat16, torch.bfloat16), (torch.float16, torch.float32),
                                          (torch.bfloat16, torch.float32)])
def test_rms_norm_dtypes(dtype, wdtype):
    x = torch.randn(5, 4096, device=DEV).to(dtype)
    w = torch.rand(4096, device=DEV).to(wdtype) + 0.5
    assert_close(cl().rms_norm(x, w, 1e-6), reference.rms_norm(x, w, 1e-6), dtype=dtype)


def test_rms_norm_strided_and_3d():
    base = torch.randn(6, 4096 + 64, device=DEV).half()
    x = base[:, 32:32 + 4096]  # row stride 4160, 16-byte aligned start
    w = torch.randn(4096, device=DEV).half()
    assert_close(cl().rms_norm(x, w, 1e-5), reference.rms_norm(x, w, 1e-5))
    x3 = torch.randn(2, 3, 576, device=DEV).half()
    w3 = torch.randn(576, device=DEV).half()
    assert_close(cl().rms_norm(x3, w3, 1e-5), reference.rms_norm(x3, w3, 1e-5))
    xo = base[:, 1:1 + 577]  # misaligned: scalar path
    w5 = torch.randn(577, device=DEV).half()
    assert_close(cl().rms_norm(xo, w5, 1e-5), reference.rms_norm(xo, w5, 1e-5))


@pytest.mark.parametrize("hidden", [576, 577, 4096, 8192])
@pytest.mark.parametrize("tokens", [1, 7, 33])
def test_add_rms_norm(hidden, tokens):
    x = torch.randn(tokens, hidden, device=DEV).half()
    r = torch.randn(tokens, hidden, device=DEV).half() * 4
    w = torch.randn(hidden, device=DEV).half()
    normed, s = cl().add_rms_norm(x, r, w, 1e-5)
    ref_n, ref_s = reference.add_rms_norm(x, r, w, 1e-5)
    assert_exact(s, ref_s, "residual sum")
    assert_close(normed, ref_n, msg="normed")


def test_add_rms_norm_inplace():
    x = torch.randn(7, 4096, device=DEV).half()
    r = torch.randn(7, 4096, device=DEV).half()
    w = torch.randn(4096, device=DEV).half()
    ref_n, ref_s = reference.add_rms_norm(x, r, w, 1e-5)
    normed = cl().add_rms_norm_(x, r, w, 1e-5)
    assert_exact(r, ref_s, "residual updated in place")
    assert_close(normed, ref_n)


# --- rope --------------------------------------------------------------------------------------------


class _Llama3:
    rope_type = "llama3"
    factor = 8.0
    low_freq_factor = 1.0
    high_freq_factor = 4.0
    original_max_position_embeddings = 8192


@pytest.mark.parametrize("heads,d", [(9, 64), (32, 128), (3, 18)])
@pytest.mark.parametrize("tokens", [1, 7, 33])
@pytest.mark.parametrize("scaling", [None, _Llama3()])
def test_apply_rope(heads, d, tokens, scaling):
    x = torch.randn(tokens, heads, d, device=DEV).half()
    pos = torch.randint(0, 131072, (tokens,), device=DEV)
    pos[0] = 0
    inv = reference.rope_inv_freq(d, 500000.0, scaling).to(DEV)
    assert_close(cl().apply_rope(x, pos, inv), reference.apply_rope(x, pos, inv), msg=f"rope {heads}x{d}")


@pytest.mark.parametrize("hq,hkv,d", [(9, 3, 64), (32, 8, 128)])
def test_apply_rope_qk_inplace_on_qkv_views(hq, hkv, d):
    t = 33
    qkv = torch.randn(t, (hq + 2 * hkv) * d, device=DEV).half()
    before = qkv.clone()
    q = qkv[:, : hq * d].view(t, hq, d)
    k = qkv[:, hq * d: (hq + hkv) * d].view(t, hkv, d)
    pos = torch.arange(1000, 1000 + t, device=DEV)
    inv = reference.rope_inv_freq(d, 10000.0).to(DEV)
    cl().apply_rope_qk_(q, k, pos, inv)
    bq = before[:, : hq * d].view(t, hq, d)
    bk = before[:, hq * d: (hq + hkv) * d].view(t, hkv, d)
    assert_close(q, reference.apply_rope(bq, pos, inv), msg="q")
    assert_close(k, reference.apply_rope(bk, pos, inv), msg="k")
    assert_exact(qkv[:, (hq + hkv) * d:], before[:, (hq + hkv) * d:], "v untouched")


# --- silu_mul, embedding, kv_cache_write -------------------------------------------------------------


@pytest.mark.parametrize("inter", [1536, 14336, 577])
@pytest.mark.parametrize("tokens", [1, 7, 33])
def test_silu_mul(inter, tokens):
    gu = torch.randn(tokens, 2 * inter, device=DEV).half() * 4
    gate, up = gu[:, :inter], gu[:, inter:]  # halves of a fused gate/up output
    assert_close(cl().silu_mul(gate, up), reference.silu_mul(gate, up), msg=f"silu_mul I={inter}")
    g2, u2 = gate.contiguous().bfloat16(), up.contiguous().bfloat16()
    assert_close(cl().silu_mul(g2, u2), reference.silu_mul(g2, u2))


@pytest.mark.parametrize("hidden", [576, 577, 4096])
def test_embedding(hidden):
    table = torch.randn(1000, hidden, device=DEV).half()
    ids = torch.randint(0, 1000, (33,), device=DEV)
    ids[3] = 999
    assert_exact(cl().embedding(ids, table), reference.embedding(ids, table))
    bad = torch.tensor([5, -1, 1000, 7], device=DEV)
    out = cl().embedding(bad, table)
    assert_exact(out[[0, 3]], table[[5, 7]])
    assert torch.all(out[[1, 2]] == 0), "out-of-range ids give zero rows"


@pytest.mark.parametrize("hkv,d,page", [(3, 64, 16), (8, 128, 256), (2, 12, 16)])
def test_kv_cache_write(hkv, d, page):
    pages, t = 9, 40
    kc = poison(torch.empty(pages, page, hkv, d, device=DEV, dtype=torch.float16))
    vc = poison(torch.empty_like(kc))
    kc_ref, vc_ref = kc.clone(), vc.clone()
    kv = torch.randn(t, 3, hkv, d, device=DEV).half()  # strided k and v views
    k, v = kv[:, 0], kv[:, 2]
    slots = torch.randperm(pages * page, device=DEV)[:t]
    slots[5] = -1  # padding token: skipped
    cl().kv_cache_write(k, v, kc, vc, slots)
    reference.kv_cache_write(k, v, kc_ref, vc_ref, slots)
    assert_exact(kc, kc_ref, "k_cache")
    assert_exact(vc, vc_ref, "v_cache")


# --- validation, opcheck, graphs ---------------------------------------------------------------------


def test_invalid_inputs_raise_typed_errors():
    x = torch.randn(3, 64, device=DEV).half()
    with pytest.raises(InvalidRequestError):
        cl().rms_norm(x, torch.randn(63, device=DEV).half(), 1e-5)
    with pytest.raises(InvalidRequestError):
        cl().rms_norm(x.cpu(), torch.randn(64).half(), 1e-5)
    with pytest.raises(InvalidRequestError):
        cl().silu_mul(x, torch.randn(3, 65, device=DEV).half())
    with pytest.raises(InvalidRequestError):
        cl().apply_rope(x.view(3, 1, 64), torch.arange(2, device=DEV), torch.ones(32, device=DEV))
    kc = torch.zeros(2, 16, 1, 64, device=DEV).half()
    with pytest.raises(InvalidRequestError):
        cl().kv_cache_write(x.view(3, 1, 64), x.view(3, 1, 64), kc, kc.clone(), torch.arange(2, device=DEV))


def test_fallback_for_fp32():
    x = torch.randn(3, 100, device=DEV)
    w = torch.randn(100, device=DEV)
    assert_close(cl().rms_norm(x, w, 1e-5), reference.rms_norm(x, w, 1e-5))


def test_opcheck():
    c = cl()
    ops = torch.ops.exl2_backend
    x = torch.randn(4, 576, device=DEV).half()
    w = torch.randn(576, device=DEV).half()
    torch.library.opcheck(ops.rms_norm.default, (x, w, 1e-5))
    torch.library.opcheck(ops.add_rms_norm.default, (x, x.clone(), w, 1e-5))
    torch.library.opcheck(ops.add_rms_norm_.default, (x, x.clone(), w, 1e-5))
    q = torch.randn(4, 9, 64, device=DEV).half()
    pos = torch.arange(4, device=DEV)
    inv = reference.rope_inv_freq(64, 10000.0).to(DEV)
    torch.library.opcheck(ops.apply_rope.default, (q, pos, inv))
    torch.library.opcheck(ops.apply_rope_qk_.default, (q.clone(), q[:, :3].clone(), pos, inv))
    torch.library.opcheck(ops.silu_mul.default, (x, x.clone()))
    torch.library.opcheck(ops.embedding.default, (torch.tensor([1, 2], device=DEV), x))
    kc = torch.zeros(2, 16, 3, 64, device=DEV).half()
    torch.library.opcheck(ops.kv_cache_write.default,
                          (q[:, :3], q[:, 3:6], kc, kc.clone(), torch.tensor([0, 5, 17, 30], device=DEV)))
    assert c is not None


def test_cuda_graph_replay_matches_eager():
    c = cl()
    hq, hkv, d, hidden = 9, 3, 64, 576
    x = torch.randn(1, hidden, device=DEV).half()
    res = torch.randn(1, hidden, device=DEV).half()
    w = torch.randn(hidden, device=DEV).half()
    qkv = torch.randn(1, (hq + 2 * hkv) * d, device=DEV).half()
    pos = torch.tensor([17], device=DEV)
    inv = reference.rope_inv_freq(d, 10000.0).to(DEV)

    def step():
        n, s = c.add_rms_norm(x, res, w, 1e-5)
        q = qkv[:, : hq * d].view(1, hq, d).clone()
        k = qkv[:, hq * d: (hq + hkv) * d].view(1, hkv, d).clone()
        c.apply_rope_qk_(q, k, pos, inv)
        return n, s, q, k, c.silu_mul(n, s)

    eager = step()
    torch.cuda.synchronize()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()  # warm-up on the side stream (allocator, library load)
    torch.cuda.current_stream().wait_stream(stream)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        static = step()
    for _ in range(2):
        x.copy_(torch.randn_like(x))
        pos.fill_(4000)
        g.replay()
        torch.cuda.synchronize()
        eager = step()
        for a, b in zip(static, eager):
            assert_exact(a, b, "graph replay vs eager")


def test_direct_path_matches_custom_ops():
    """cuda_layers.direct holds the very functions the custom ops run, callable without the dispatcher."""
    c = cl()
    x = torch.randn(7, 576, device=DEV).half()
    r = torch.randn(7, 576, device=DEV).half()
    w = torch.randn(576, device=DEV).half()
    assert_exact(c.direct.rms_norm(x, w, 1e-5), c.rms_norm(x, w, 1e-5))
    for a, b in zip(c.direct.add_rms_norm(x, r, w, 1e-5), c.add_rms_norm(x, r, w, 1e-5)):
        assert_exact(a, b)
    q = torch.randn(7, 9, 64, device=DEV).half()
    pos = torch.arange(7, device=DEV)
    inv = reference.rope_inv_freq(64, 10000.0).to(DEV)
    assert_exact(c.direct.apply_rope(q, pos, inv), c.apply_rope(q, pos, inv))
    assert_exact(c.direct.silu_mul(x, r), c.silu_mul(x, r))
    ids = torch.tensor([0, 6, 3], device=DEV)
    assert_exact(c.direct.embedding(ids, x), c.embedding(ids, x))


# --- rope_kv_write (rope of q and k + KV-cache write, one launch) ------------------------------------


@pytest.mark.parametrize("hq,hkv,d,dtype", [(9, 3, 64, torch.float16), (32, 8, 128, torch.float16),
                                            (32, 8, 128, torch.bfloat16), (4, 2, 12, torch.float16)])
@pytest.mark.parametrize("t", [1, 5, 40])
def test_rope_kv_write(hq, hkv, d, dtype, t):
    pages, page = 9, 16
    qkv = torch.randn(t, (hq + 2 * hkv) * d, device=DEV).to(dtype) * 2
    before = qkv.clone()
    q = qkv[:, : hq * d].view(t, hq, d)
    k = qkv[:, hq * d: (hq + hkv) * d].view(t, hkv, d)
    v = qkv[:, (hq + hkv) * d:].view(t, hkv, d)
    pos = torch.randint(0, 100000, (t,), device=DEV)
    inv = reference.rope_inv_freq(d, 500000.0, _Llama3()).to(DEV)
    slots = torch.randperm(pages * page, device=DEV)[:t]
    if t > 1:
        slots[t // 2] = -1  # padding token: no cache write
    kc = poison(torch.empty(pages, page, hkv, d, device=DEV, dtype=dtype))
    vc = poison(torch.empty_like(kc))
    kc2, vc2, kc_ref, vc_ref = kc.clone(), vc.clone(), kc.clone(), vc.clone()
    cl().rope_kv_write(q, k, v, pos, inv, kc, vc, slots)
    # the same bits as the unfused CUDA ops
    bq = before[:, : hq * d].view(t, hq, d)
    bk = before[:, hq * d: (hq + hkv) * d].view(t, hkv, d)
    bv = before[:, (hq + hkv) * d:].view(t, hkv, d)
    assert_exact(q, cl().apply_rope(bq, pos, inv), "q vs apply_rope")
    cl().kv_cache_write(cl().apply_rope(bk, pos, inv), bv, kc2, vc2, slots)
    assert_exact(kc, kc2, "k_cache vs apply_rope + kv_cache_write")
    assert_exact(vc, vc2, "v_cache vs kv_cache_write")
    assert_exact(qkv[:, hq * d:], before[:, hq * d:], "k and v inputs untouched")
    # and close to the reference op
    qr = bq.clone()
    reference.rope_kv_write(qr, bk.clone(), bv.clone(), pos, inv, kc_ref, vc_ref, slots)
    assert_close(q, qr, dtype=dtype, msg="q vs reference")
    keep = slots >= 0
    assert_close(kc.view(-1, hkv, d)[slots[keep]], kc_ref.view(-1, hkv, d)[slots[keep]], dtype=dtype, msg="k")
    assert_exact(vc.view(-1, hkv, d)[slots[keep]], vc_ref.view(-1, hkv, d)[slots[keep]], "v")
    untouched = torch.ones(pages * page, dtype=torch.bool, device=DEV)
    untouched[slots[keep]] = False
    assert torch.isnan(kc.view(-1, hkv, d)[untouched].float()).all(), "only the slots are written"


def test_rope_kv_write_graph_and_opcheck():
    c = cl()
    hq, hkv, d = 9, 3, 64
    qkv = torch.randn(1, (hq + 2 * hkv) * d, device=DEV).half()
    kc = torch.zeros(4, 16, hkv, d, device=DEV).half()
    vc = torch.zeros_like(kc)
    pos = torch.tensor([5], device=DEV)
    slots = torch.tensor([21], device=DEV)
    inv = reference.rope_inv_freq(d, 10000.0).to(DEV)

    def step():
        x = qkv.clone()
        q, k, v = x[:, : hq * d].view(1, hq, d), x[:, hq * d: (hq + hkv) * d].view(1, hkv, d), x[:, (hq + hkv) * d:]
        c.rope_kv_write(q, k, v.view(1, hkv, d), pos, inv, kc, vc, slots)
        return q

    step()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        step()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        static = step()
    for p_, sl in ((77, 3), (4000, 60)):
        qkv.copy_(torch.randn_like(qkv))
        pos.fill_(p_)
        slots.fill_(sl)
        g.replay()
        torch.cuda.synchronize()
        kg, vg = kc.clone(), vc.clone()
        assert_exact(static, step(), "graph replay vs eager (q)")
        assert_exact(kc, kg, "graph replay vs eager (k_cache)")
        assert_exact(vc, vg, "graph replay vs eager (v_cache)")
    q = torch.randn(4, 9, 64, device=DEV).half()
    kv = torch.randn(4, 2, 3, 64, device=DEV).half()
    torch.library.opcheck(torch.ops.exl2_backend.rope_kv_write.default,
                          (q, kv[:, 0], kv[:, 1], torch.arange(4, device=DEV), inv, kc.clone(), vc.clone(),
                           torch.tensor([0, 5, -1, 30], device=DEV)))
