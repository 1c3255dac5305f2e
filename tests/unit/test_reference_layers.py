"""Reference linears, norms, rotary embedding, activation and embedding against torch / transformers."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaRMSNorm, LlamaRotaryEmbedding, apply_rotary_pos_emb

from exl2_backend import ops
from exl2_backend.ops import reference
from tests.helpers.tolerances import assert_close, assert_close_rel, assert_exact
from tests.unit.test_reference_dequant import make_qtensor

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def dense(n, k, bias, seed):
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(n, k, generator=g) * 0.05).half()
    b = (torch.randn(n, generator=g) * 0.1).half() if bias else None
    return SimpleNamespace(key=f"dense{seed}", weight=w, bias=b)


# --- linears -------------------------------------------------------------------------------------------


@torch.inference_mode()
@pytest.mark.parametrize("bias", [False, True])
def test_exl2_gemm_is_dequant_matmul(bias):
    qt = make_qtensor([(8, 32), (4, 96), (2, 64)], n=50, seed=1, bias=bias)
    x = torch.randn(7, qt.in_features).half()
    w = reference.exl2_dequant(qt).float()[:, :50]
    want = x.float() @ w + (qt.bias[:50].float() if bias else 0)
    got = reference.exl2_gemm(x, qt)
    assert got.shape == (7, 50) and got.dtype == torch.float16
    assert_exact(got, want.half())
    assert_exact(ops.exl2_gemm(x, qt), got)  # CPU dispatch goes to the reference


@torch.inference_mode()
def test_prepare_linear_fused_equals_separate():
    q = make_qtensor([(6, 64), (4, 64)], n=96, seed=2, bias=True, key="q")
    k = make_qtensor([(5, 32), (3, 96)], n=40, seed=3, key="k")  # no bias: zeros in the fused bias
    v = dense(24, 128, bias=True, seed=4)
    x = torch.randn(5, 128).half()
    fused = ops.prepare_linear([q, k, v], "cpu", torch.float16)
    assert fused.splits == [96, 40, 24] and fused.in_features == 128 and fused.out_features == 160
    y = fused(x)
    assert y.dtype == torch.float16 and y.shape == (5, 160)
    parts = [reference.prepare_linear([lin], "cpu", torch.float16)(x) for lin in (q, k, v)]
    assert_exact(y, torch.cat(parts, dim=-1))
    # and each part equals the documented op
    assert_close(parts[0], reference.exl2_gemm(x, q))
    assert_close(parts[1], reference.exl2_gemm(x, k))
    assert_close(parts[2], reference.dense_linear(x, v.weight, v.bias))
    assert fused(x.reshape(5, 1, 128)).shape == (5, 1, 160)


@torch.inference_mode()
def test_dense_linear_with_bias_and_cpu_fp32_storage():
    lin = dense(33, 64, bias=True, seed=5)
    x = torch.randn(4, 64).half()
    want = x.float() @ lin.weight.float().t() + lin.bias.float()
    assert_exact(reference.dense_linear(x, lin.weight, lin.bias), want.half())
    assert_exact(reference.dense_linear(x, lin.weight, None), (x.float() @ lin.weight.float().t()).half())
    op = reference.prepare_linear([lin], torch.device("cpu"), torch.float16)
    assert op.weight_t.dtype == torch.float32  # CPU keeps fp32
    assert_exact(op(x), want.half())
    # same-precision check: an fp16-rounded matmul is no closer than ours
    assert_close_rel(op(x), want, (x.float() @ lin.weight.float().t()).half() + lin.bias)


def test_prepare_linear_rejects_mismatched_inputs():
    with pytest.raises(Exception, match="in_features"):
        reference.prepare_linear([dense(8, 64, False, 1), dense(8, 32, False, 2)], "cpu")


# --- norms, activation, embedding ----------------------------------------------------------------------


@torch.inference_mode()
def test_rms_norm_matches_llama():
    x = torch.randn(9, 96) * 3
    w = torch.randn(96)
    hf = LlamaRMSNorm(96, eps=1e-5)
    hf.weight.copy_(w)
    assert_close(reference.rms_norm(x, w, 1e-5), hf(x))
    xh = x.half()
    out = reference.rms_norm(xh, w.half(), 1e-5)
    assert out.dtype == torch.float16
    assert_close(out, hf(x), dtype=torch.float16)


@torch.inference_mode()
def test_add_rms_norm():
    x, r, w = torch.randn(6, 64), torch.randn(6, 64), torch.randn(64)
    hf = LlamaRMSNorm(64, eps=1e-6)
    hf.weight.copy_(w)
    normed, summed = reference.add_rms_norm(x, r, w, 1e-6)
    assert_exact(summed, x + r)
    assert_close(normed, hf(x + r))
    nh, sh = reference.add_rms_norm(x.half(), r.half(), w.half(), 1e-6)
    assert_exact(sh, (x.half().float() + r.half().float()).half())
    assert_exact(nh, reference.rms_norm(sh, w.half(), 1e-6))


@torch.inference_mode()
def test_silu_mul():
    g, u = torch.randn(5, 80) * 4, torch.randn(5, 80)
    assert_close(reference.silu_mul(g, u), torch.nn.functional.silu(g) * u)
    assert_close(reference.silu_mul(g.half(), u.half()), torch.nn.functional.silu(g) * u, dtype=torch.float16)


def test_embedding():
    table = torch.randn(50, 16).half()
    ids = torch.tensor([3, 0, 49, 3], dtype=torch.int64)
    assert_exact(reference.embedding(ids, table), table[ids])
    assert_exact(ops.embedding(ids, table), table[ids])


# --- rotary embedding ----------------------------------------------------------------------------------

ROPE_CASES = {
    "default": ({"rope_type": "default", "rope_theta": 10000.0}, None),
    "linear": (
        {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0},
        SimpleNamespace(rope_type="linear", factor=4.0, low_freq_factor=None, high_freq_factor=None,
                        original_max_position_embeddings=None),
    ),
    "llama3": (
        {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
         "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
        SimpleNamespace(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                        original_max_position_embeddings=8192),
    ),
}


@torch.inference_mode()
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("case", list(ROPE_CASES))
def test_rope_matches_transformers(case, head_dim):
    params, scaling = ROPE_CASES[case]
    cfg = LlamaConfig(hidden_size=4 * head_dim, num_attention_heads=4, head_dim=head_dim,
                      max_position_embeddings=131072, rope_parameters=dict(params))
    hf = LlamaRotaryEmbedding(cfg)
    inv = reference.rope_inv_freq(head_dim, params["rope_theta"], scaling)
    assert inv.dtype == torch.float32 and inv.shape == (head_dim // 2,)
    assert_close(inv, hf.inv_freq)
    assert_exact(ops.rope_inv_freq(head_dim, params["rope_theta"], scaling), inv)

    pos = torch.tensor([0, 1, 7, 100, 4095, 8191, 8192, 32767, 100000], dtype=torch.int64)
    q, k = torch.randn(len(pos), 4, head_dim), torch.randn(len(pos), 2, head_dim)
    cos, sin = hf(q, pos[None])  # [1, T, D]
    # HF layout [B, H, T, D]
    q_hf, k_hf = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin)
    for x, want in ((q, q_hf[0].transpose(0, 1)), (k, k_hf[0].transpose(0, 1))):
        got = reference.apply_rope(x, pos, inv)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # fp16 input: fp32 angle math, one rounding
    got16 = reference.apply_rope(q.half(), pos, inv)
    assert got16.dtype == torch.float16
    assert_close(got16, reference.apply_rope(q.half().float(), pos, inv), dtype=torch.float16)


def test_rope_linear_equals_scaled_positions():
    scaling = ROPE_CASES["linear"][1]
    pos = torch.arange(0, 4000, 37)
    x = torch.randn(len(pos), 2, 64)
    scaled = reference.apply_rope(x, pos, reference.rope_inv_freq(64, 10000.0, scaling))
    plain_inv = reference.rope_inv_freq(64, 10000.0, None)
    ang = (pos.double()[:, None] / 4.0) * plain_inv.double()[None]
    cos, sin = ang.cos()[:, None].float(), ang.sin()[:, None].float()
    want = torch.cat((x[..., :32] * cos - x[..., 32:] * sin, x[..., 32:] * cos + x[..., :32] * sin), -1)
    torch.testing.assert_close(scaled, want, rtol=1e-4, atol=1e-4)


def test_rope_unknown_type_is_config_error():
    from exl2_backend.errors import ConfigError

    with pytest.raises(ConfigError):
        reference.rope_inv_freq(64, 10000.0, SimpleNamespace(rope_type="yarn", factor=2.0))


def test_rope_accepts_config_rope_scaling():
    config = pytest.importorskip("exl2_backend.format.config")
    ns = ROPE_CASES["llama3"][1]
    scaling = config.RopeScaling(rope_type="llama3", factor=ns.factor, low_freq_factor=ns.low_freq_factor,
                                 high_freq_factor=ns.high_freq_factor,
                                 original_max_position_embeddings=ns.original_max_position_embeddings)
    assert_exact(reference.rope_inv_freq(128, 500000.0, scaling), reference.rope_inv_freq(128, 500000.0, ns))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_rope_kv_write_equals_rope_then_cache_write(dtype):
    """rope_kv_write (q rotated in place, rotated k and v into the cache) == apply_rope x2 + kv_cache_write,
    through the dispatcher on CPU, on strided views of a fused QKV output, with a padding slot."""
    t, hq, hkv, d, pages, page = 5, 4, 2, 16, 3, 8
    qkv = torch.randn(t, (hq + 2 * hkv) * d).to(dtype)
    before = qkv.clone()
    q = qkv[:, : hq * d].view(t, hq, d)
    k = qkv[:, hq * d: (hq + hkv) * d].view(t, hkv, d)
    v = qkv[:, (hq + hkv) * d:].view(t, hkv, d)
    pos = torch.tensor([0, 3, 9, 100, 7])
    inv = reference.rope_inv_freq(d, 10000.0)
    slots = torch.tensor([4, 0, -1, 23, 11])
    kc = torch.full((pages, page, hkv, d), 7.0, dtype=dtype)
    vc = torch.full_like(kc, 7.0)
    kc2, vc2 = kc.clone(), vc.clone()
    ops.rope_kv_write(q, k, v, pos, inv, kc, vc, slots)
    bq, bk, bv = (before[:, a:b].view(t, -1, d) for a, b in ((0, hq * d), (hq * d, (hq + hkv) * d),
                                                                ((hq + hkv) * d, (hq + 2 * hkv) * d)))
    assert_exact(q, reference.apply_rope(bq, pos, inv), "q rotated in place")
    reference.kv_cache_write(reference.apply_rope(bk, pos, inv), bv, kc2, vc2, slots)
    assert_exact(kc, kc2, "k_cache")
    assert_exact(vc, vc2, "v_cache")
    assert_exact(qkv[:, hq * d:], before[:, hq * d:], "k, v inputs untouched")
