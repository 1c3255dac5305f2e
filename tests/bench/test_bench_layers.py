"""pytest-benchmark suites for the layer kernels at decode shapes (GPU only; tests/conftest.py marks tests/bench
as `cuda` + `benchmark`). A round replays one CUDA graph of the kernel launched back to back for about 2 ms and
synchronizes (`exl2_backend.bench.timing.GraphRounds`): a single eager launch plus a sync was mostly host time, and
two runs of it differed by up to 50% (H200 call AI2). extra_info carries µs per kernel; the attention benchmarks
rotate through copies of the cache larger than L2 together, as a decode step reads each layer's cache once.
scripts/bench_attention.py prints the full tables with GB/s.
"""

from __future__ import annotations

import math

import pytest
import torch

from exl2_backend.bench.timing import GraphRounds

DEV = "cuda"
L2_PAST_BYTES = 180 << 20  # more than the H200's 50 MB L2, as the GEMV suite


@pytest.fixture(scope="module")
def cl():
    from exl2_backend.ops import cuda_layers

    return cuda_layers


def graph_bench(benchmark, calls, **info) -> GraphRounds:
    rounds = GraphRounds(calls)
    benchmark.pedantic(rounds, rounds=30, iterations=1, warmup_rounds=2)
    benchmark.extra_info.update({"us_per_kernel": rounds.us_per_call, "kernels_per_round": rounds.calls_per_round,
                                 **info})
    return rounds


def copies_past_l2(nbytes: int) -> int:
    return max(1, math.ceil(L2_PAST_BYTES / nbytes))


@pytest.mark.parametrize("ctx", [2048, 8192, 32768])
def test_bench_paged_attention_decode(benchmark, cl, ctx):
    hq, hkv, d, page = 32, 8, 128, 256
    pages = ctx // page
    copies = copies_past_l2(2 * pages * page * hkv * d * 2)
    kcs = [torch.randn(pages, page, hkv, d, device=DEV, dtype=torch.float16) for _ in range(copies)]
    vcs = [torch.randn_like(kcs[0]) for _ in range(copies)]
    tables = torch.randperm(pages, device=DEV, dtype=torch.int32)[None]
    lens = torch.tensor([ctx], dtype=torch.int32, device=DEV)
    q = torch.randn(1, 1, hq, d, device=DEV, dtype=torch.float16)
    out = cl.paged_attention(q, kcs[0], vcs[0], tables, lens, 1 / math.sqrt(d))
    assert out.shape == q.shape and torch.isfinite(out).all()
    graph_bench(benchmark, [lambda i=i: cl.paged_attention(q, kcs[i], vcs[i], tables, lens, 1 / math.sqrt(d))
                            for i in range(copies)], context=ctx)


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

    def make_caches():
        caches = []
        for fmt in (kf, vf):
            codes = torch.randint(0, 256, (pages, page, hkv, FORMATS[fmt].code_bytes(d)), generator=g, device=DEV,
                                  dtype=torch.int32).to(torch.uint8)
            scales = torch.rand(pages, page, hkv, d // 32, generator=g, device=DEV).half() * 0.02
            caches += [codes, scales]
        return caches

    first = make_caches()
    copies = copies_past_l2(sum(t.numel() * t.element_size() for t in first))
    sets = [first] + [make_caches() for _ in range(copies - 1)]
    tables = torch.randperm(pages, device=DEV, dtype=torch.int32)[None]
    lens = torch.tensor([ctx], dtype=torch.int32, device=DEV)
    q = torch.randn(1, 1, hq, d, device=DEV, dtype=torch.float16)

    def attend(i):
        return cuda_kvquant.paged_attention_quant(q, *sets[i], tables, lens, 1 / math.sqrt(d), kf, vf)

    out = attend(0)
    assert out.shape == q.shape and torch.isfinite(out).all()
    graph_bench(benchmark, [lambda i=i: attend(i) for i in range(copies)], context=ctx)


def test_bench_rms_norm_decode(benchmark, cl):
    x = torch.randn(1, 4096, device=DEV, dtype=torch.float16)
    w = torch.randn(4096, device=DEV, dtype=torch.float16)
    graph_bench(benchmark, [lambda: cl.add_rms_norm(x, x, w, 1e-5)])


def test_bench_rope_decode(benchmark, cl):
    qkv = torch.randn(1, 48 * 128, device=DEV, dtype=torch.float16)
    q, k = qkv[:, : 32 * 128].view(1, 32, 128), qkv[:, 32 * 128: 40 * 128].view(1, 8, 128)
    pos = torch.tensor([1234], device=DEV)
    inv = torch.rand(64, device=DEV)
    graph_bench(benchmark, [lambda: cl.apply_rope_qk_(q, k, pos, inv)])


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_bench_sample_tokens_128k(benchmark, cl, temperature):
    logits = torch.randn(1, 128256, device=DEV)
    u = 1.0 - torch.rand_like(logits)
    temp = torch.full((1,), temperature, device=DEV)
    out = cl.sample_tokens_tensor(logits, u, temp)
    assert 0 <= int(out[0]) < 128256
    graph_bench(benchmark, [lambda: cl.sample_tokens_tensor(logits, u, temp)])
