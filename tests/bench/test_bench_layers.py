"""pytest-benchmark suites for the layer kernels at decode shapes (GPU only; tests/conftest.py marks tests/bench
as `cuda` + `benchmark`). Each round is one eager call plus a device sync, i.e. what an unbatched Python caller
sees; scripts/bench_attention.py gives graph-replay kernel times and GB/s."""

from __future__ import annotations

import math

import pytest
import torch

DEV = "cuda"


@pytest.fixture(scope="module")
def cl():
    from exl2_backend.ops import cuda_layers

    return cuda_layers


def synced(fn):
    def run():
        out = fn()
        torch.cuda.synchronize()
        return out

    return run


@pytest.mark.parametrize("ctx", [2048, 8192, 32768])
def test_bench_paged_attention_decode(benchmark, cl, ctx):
    hq, hkv, d, page = 32, 8, 128, 256
    pages = ctx // page
    kc = torch.randn(pages, page, hkv, d, device=DEV, dtype=torch.float16)
    vc = torch.randn_like(kc)
    tables = torch.randperm(pages, device=DEV, dtype=torch.int32)[None]
    lens = torch.tensor([ctx], dtype=torch.int32, device=DEV)
    q = torch.randn(1, 1, hq, d, device=DEV, dtype=torch.float16)
    out = benchmark(synced(lambda: cl.paged_attention(q, kc, vc, tables, lens, 1 / math.sqrt(d))))
    assert out.shape == q.shape and torch.isfinite(out).all()


@pytest.mark.parametrize("kernel", ["mma", "cuda_core"])
@pytest.mark.parametrize("cache_type", ["q8", "q4"])
@pytest.mark.parametrize("ctx", [8192, 32768])
def test_bench_paged_attention_quant_decode(benchmark, monkeypatch, ctx, cache_type, kernel):
    """Decode attention over quantized pages (8B shape, one query): the tensor-core kernel (the default) against
    the CUDA-core one."""
    from exl2_backend.cache.kv_types import FORMATS, get_cache_type
    from exl2_backend.ops import cuda_kvquant

    monkeypatch.setattr(cuda_kvquant, "ATTN_QUANT_MMA", kernel == "mma")
    hq, hkv, d, page = 32, 8, 128, 256
    pages = ctx // page
    kf, vf = get_cache_type(cache_type).k.name, get_cache_type(cache_type).v.name
    g = torch.Generator(device=DEV).manual_seed(0)
    caches = []
    for fmt in (kf, vf):
        codes = torch.randint(0, 256, (pages, page, hkv, FORMATS[fmt].code_bytes(d)), generator=g, device=DEV,
                              dtype=torch.int32).to(torch.uint8)
        scales = torch.rand(pages, page, hkv, d // 32, generator=g, device=DEV).half() * 0.02
        caches += [codes, scales]
    tables = torch.randperm(pages, device=DEV, dtype=torch.int32)[None]
    lens = torch.tensor([ctx], dtype=torch.int32, device=DEV)
    q = torch.randn(1, 1, hq, d, device=DEV, dtype=torch.float16)
    out = benchmark(synced(lambda: cuda_kvquant.paged_attention_quant(q, *caches, tables, lens, 1 / math.sqrt(d),
                                                                      kf, vf)))
    assert out.shape == q.shape and torch.isfinite(out).all()


def test_bench_rms_norm_decode(benchmark, cl):
    x = torch.randn(1, 4096, device=DEV, dtype=torch.float16)
    w = torch.randn(4096, device=DEV, dtype=torch.float16)
    benchmark(synced(lambda: cl.add_rms_norm(x, x, w, 1e-5)))


def test_bench_rope_decode(benchmark, cl):
    qkv = torch.randn(1, 48 * 128, device=DEV, dtype=torch.float16)
    q, k = qkv[:, : 32 * 128].view(1, 32, 128), qkv[:, 32 * 128: 40 * 128].view(1, 8, 128)
    pos = torch.tensor([1234], device=DEV)
    inv = torch.rand(64, device=DEV)
    benchmark(synced(lambda: cl.apply_rope_qk_(q, k, pos, inv)))


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_bench_sample_tokens_128k(benchmark, cl, temperature):
    logits = torch.randn(1, 128256, device=DEV)
    u = 1.0 - torch.rand_like(logits)
    temp = torch.full((1,), temperature, device=DEV)
    out = benchmark(synced(lambda: cl.sample_tokens_tensor(logits, u, temp)))
    assert 0 <= int(out[0]) < 128256
