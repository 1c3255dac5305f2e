"""CUDA paged attention (csrc/layers/paged_attention.cu) against the reference.

Tolerance (tests/helpers/tolerances.py `assert_close_rel`): max |out - ref_fp32| <= 2 x the error of fp16 SDPA
(torch, same inputs, K/V expanded for GQA) against the same fp32 reference, + 2e-3. The fp32 reference is
reference.paged_attention on fp32 copies of q and the caches.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from exl2_backend.ops import reference
from tests.helpers.tolerances import assert_close_rel, assert_exact

pytestmark = pytest.mark.cuda

DEV = "cuda"


def cl():
    from exl2_backend.ops import cuda_layers

    return cuda_layers


def build(lens, hkv, d, page, seed=0, spare=5):
    """Random K/V per sequence in shuffled, non-contiguous pages; unused cache slots are NaN and unused block
    table entries garbage, so any read outside the context shows up. -> (kc, vc, tables, lens, [(k, v)])."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    need = [max(1, -(-n // page)) for n in lens]
    num_pages = sum(need) + spare
    kc = torch.full((num_pages, page, hkv, d), float("nan"), dtype=torch.float16, device=DEV)
    vc = torch.full_like(kc, float("nan"))
    order = torch.randperm(num_pages, generator=g).tolist()
    tables = torch.full((len(lens), max(need) + 2), -1, dtype=torch.int32)
    tables[:, -1] = 10**6
    kv = []
    for b, n in enumerate(lens):
        pages = [order.pop() for _ in range(need[b])]
        tables[b, : need[b]] = torch.tensor(pages, dtype=torch.int32)
        k = torch.randn(n, hkv, d, generator=g).half().to(DEV)
        v = torch.randn(n, hkv, d, generator=g).half().to(DEV)
        pos = torch.arange(n)
        slots = (torch.tensor(pages)[pos // page] * page + pos % page).to(DEV)
        cl().kv_cache_write(k, v, kc, vc, slots)
        kv.append((k, v))
    return kc, vc, tables.to(DEV), torch.tensor(lens, dtype=torch.int32, device=DEV), kv


def sdpa_fp16(q, kv, lens, scale):
    """fp16 SDPA per sequence, GQA expanded, causal by absolute position (the same-precision baseline)."""
    tq, hq = q.shape[1], q.shape[2]
    out = torch.zeros_like(q)
    for b, (k, v) in enumerate(kv):
        n = lens[b]
        if n <= 0:
            continue
        grp = hq // k.shape[1]
        kk = k.repeat_interleave(grp, dim=1).transpose(0, 1)[None]
        vv = v.repeat_interleave(grp, dim=1).transpose(0, 1)[None]
        qq = q[b].transpose(0, 1)[None]
        mask = torch.arange(n, device=DEV)[None, :] <= (torch.arange(tq, device=DEV) + n - tq)[:, None]
        o = F.scaled_dot_product_attention(qq, kk, vv, attn_mask=mask, scale=scale)[0].transpose(0, 1)
        out[b] = torch.where(mask.any(-1)[:, None, None], o, torch.zeros_like(o))
    return out


def check(lens, tq, hq, hkv, d, page=16, num_splits=0, seed=0, q=None):
    kc, vc, tables, ctx, kv = build(lens, hkv, d, page, seed)
    if q is None:
        q = torch.randn(len(lens), tq, hq, d, device=DEV).half()
    scale = 1 / math.sqrt(d)
    out = cl().paged_attention(q, kc, vc, tables, ctx, scale, num_splits)
    ref = reference.paged_attention(q.float(), kc.float(), vc.float(), tables, ctx, scale)
    base = sdpa_fp16(q.contiguous(), kv, list(lens), scale)
    assert_close_rel(out, ref, base, msg=f"lens={lens} tq={tq} {hq}/{hkv}x{d} page={page} splits={num_splits}")
    return out


@pytest.fixture(autouse=True)
def other_kernels(monkeypatch):
    """The kernels this module tests by name: the tensor-core streamed kernel (the default for fp16 decode steps
    over 8 kv heads) only where a test or the `stream` case of attn_kernel asks for it."""
    monkeypatch.setattr(cl(), "ATTN_STREAM_FP16", False)


@pytest.fixture(params=["cuda_core", "mma", "mma_online", "mma_online2", "staged", "staged_tiles", "stream"])
def attn_kernel(request, monkeypatch):
    """Every kernel for fp16 pages: the CUDA-core one and the tensor-core one of the quantized caches
    (ops/cuda_layers.ATTN_FP16_MMA: row tiles of 8, fp16 operands, q and probabilities in two fp16 parts), two
    passes or one with one or two key steps in flight (ATTN_MMA_ONLINE 1 / 2; 2 is the fp16 pages' default), or
    two steps staged in shared memory (ATTN_STAGED "2"; the default for fp16 pages only where row tiles share
    rings: ATTN_SHARED_TILES, more than 8 rows per kv head); or the streamed kernel (ATTN_STREAM: decode steps of
    the shapes it takes, the others on the default route)."""
    monkeypatch.setattr(cl(), "ATTN_STREAM", request.param == "stream")
    if request.param == "stream":
        return request.param
    monkeypatch.setattr(cl(), "ATTN_FP16_MMA", request.param != "cuda_core")
    online = {"mma_online": 1, "mma_online2": 2, "staged": 2, "staged_tiles": 2}.get(request.param, 0)
    monkeypatch.setattr(cl(), "ATTN_MMA_ONLINE", online)
    monkeypatch.setattr(cl(), "ATTN_STAGED", "2" if request.param.startswith("staged") else "0")
    monkeypatch.setattr(cl(), "ATTN_SHARED_TILES", request.param == "staged_tiles")
    return request.param


@pytest.mark.parametrize("n", [1, 15, 16, 17, 255, 256, 257, 1000, 8192])
@pytest.mark.parametrize("tq", [1, 5])
@pytest.mark.parametrize("hq,hkv,d", [(9, 3, 64), (32, 8, 128)])
@pytest.mark.usefixtures("attn_kernel")
def test_single_sequence(n, tq, hq, hkv, d):
    if n < tq:
        pytest.skip("fewer keys than queries is covered by test_short_contexts")
    check([n], tq, hq, hkv, d, page=256 if n >= 1000 else 16)


@pytest.mark.parametrize("page", [16, 64, 256])
@pytest.mark.usefixtures("attn_kernel")
def test_batch_of_lengths(page):
    g = torch.Generator().manual_seed(3)
    lens = torch.randint(1, 1500, (32,), generator=g).tolist()
    lens[0], lens[1], lens[2] = 1, 256, 4097
    check(lens, 1, 32, 8, 128, page=page)
    check(lens[:7], 4, 9, 3, 64, page=page, seed=1)


@pytest.mark.parametrize("num_splits", [1, 2, 3, 7, 64, 120])  # 120: the reduce's unstaged loop at D = 128
@pytest.mark.usefixtures("attn_kernel")
def test_forced_splits(num_splits):
    lens = [1, 17, 300, 2000] if num_splits > 1 else [1, 17, 300, 900]  # one split holds <= 1024 keys
    check(lens, 1, 32, 8, 128, page=16, num_splits=num_splits)
    check(lens, 3, 9, 3, 64, page=16, num_splits=num_splits)


@pytest.mark.parametrize("tq,hq,hkv", [(16, 32, 8), (16, 9, 3), (2, 64, 8), (1, 8, 8), (3, 16, 8), (7, 32, 8),
                                       (32, 32, 8)])
@pytest.mark.usefixtures("attn_kernel")
def test_row_tiles(tq, hq, hkv):
    """G * Tq query rows per kv head from 1 to 128: every row-tile size, several tiles per head (Tq = 32: a short
    suffix over a cached prefix, EXL2_BACKEND_DECODE_ATTN_MAX_Q=32)."""
    check([40, 700, 2500], tq, hq, hkv, 128, page=64)
    check([33], tq, hq, hkv, 64, page=16, seed=2)


@pytest.mark.parametrize("cap", [4, 8])
def test_row_tile_cap(monkeypatch, cap):
    """ATTN_MAX_ROW_TILE (flags bits 1-2): a verify step's rows in more, smaller tiles, the same function; with
    the kernel's splits (keys per split by the capped tile) and the ticket combine."""
    monkeypatch.setattr(cl(), "ATTN_MAX_ROW_TILE", cap)
    assert cl()._attn_row_tile(20) == cap and cl()._attn_row_tile(2) == 2
    check([40, 700, 2500], 5, 32, 8, 128, page=64)  # 20 rows per kv head: 5 tiles of 4 or 3 of 8
    check([33, 1500], 9, 9, 3, 64, page=16, seed=3)
    monkeypatch.setenv("EXL2_BACKEND_ATTN_TICKETS", "1")
    check([300, 2000], 5, 32, 8, 128, page=64, seed=4)


def test_deep_unroll_variant(monkeypatch):
    """flags bit 0 (8 key steps in flight, row tiles <= 4) computes the same function."""
    monkeypatch.setattr(cl(), "_ATTN_FLAGS", 1)
    check([1, 17, 257, 3000], 1, 32, 8, 128, page=16)
    check([1, 17, 257, 3000], 1, 9, 3, 64, page=256, num_splits=5)
    check([300, 40], 1, 16, 8, 128, page=64)  # G = 2: row tile 2
    check([0, 2, 100], 1, 8, 8, 64, page=16)  # G = 1: row tile 1


@pytest.mark.usefixtures("attn_kernel")
def test_short_contexts():
    """No keys (context 0) and queries before position 0 (context < Tq) give zeros, as the reference."""
    out = check([0, 2, 5, 100], 5, 9, 3, 64)
    assert torch.all(out[0] == 0) and torch.all(out[1, :3] == 0)
    out = check([0, 3], 1, 32, 8, 128, num_splits=4)
    assert torch.all(out[0] == 0)


@pytest.mark.usefixtures("attn_kernel")
def test_strided_q_from_qkv():
    b, tq, hq, hkv, d = 2, 3, 32, 8, 128
    qkv = torch.randn(b, tq, (hq + 2 * hkv) * d, device=DEV).half()
    q = qkv[..., : hq * d].view(b, tq, hq, d)
    check([50, 3000], tq, hq, hkv, d, page=256, q=q)


@pytest.mark.usefixtures("attn_kernel")
def test_deterministic():
    kc, vc, tables, ctx, _ = build([5000, 7000], 8, 128, 256)
    q = torch.randn(2, 1, 32, 128, device=DEV).half()
    a = cl().paged_attention(q, kc, vc, tables, ctx, 0.1)
    for _ in range(3):
        assert_exact(cl().paged_attention(q, kc, vc, tables, ctx, 0.1), a, "run to run")


@pytest.mark.usefixtures("attn_kernel")
def test_cuda_graph_replay():
    """Captured once with a fixed block-table width; replays see new lengths, tables and queries."""
    hq, hkv, d, page = 32, 8, 128, 256
    kc, vc, tables, ctx, _ = build([3000, 9000], hkv, d, page)
    q = torch.randn(2, 1, hq, d, device=DEV).half()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        cl().paged_attention(q, kc, vc, tables, ctx, 0.08)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = cl().paged_attention(q, kc, vc, tables, ctx, 0.08)
    for lens in ([3000, 9000], [1, 8999], [2999, 257]):
        ctx.copy_(torch.tensor(lens, dtype=torch.int32))
        q.copy_(torch.randn_like(q))
        g.replay()
        torch.cuda.synchronize()
        assert_exact(out, cl().paged_attention(q, kc, vc, tables, ctx, 0.08), f"replay lens={lens}")


def test_fallback_head_dim_96():
    kc, vc, tables, ctx, _ = build([40], 2, 96, 16)
    q = torch.randn(1, 1, 4, 96, device=DEV).half()
    out = cl().paged_attention(q, kc, vc, tables, ctx, 0.1)
    torch.testing.assert_close(out, reference.paged_attention(q, kc, vc, tables, ctx, 0.1))


def test_opcheck():
    kc, vc, tables, ctx, _ = build([20, 300], 3, 64, 16)
    q = torch.randn(2, 2, 9, 64, device=DEV).half()
    torch.library.opcheck(torch.ops.exl2_backend.paged_attention.default, (q, kc, vc, tables, ctx, 0.125))


def test_no_host_sync():
    kc, vc, tables, ctx, _ = build([100, 5000], 8, 128, 256)
    q = torch.randn(2, 1, 32, 128, device=DEV).half()
    k = torch.randn(2, 8, 128, device=DEV).half()
    slots = torch.tensor([3, 700], device=DEV)
    cl().paged_attention(q, kc, vc, tables, ctx, 0.1)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        cl().kv_cache_write(k, k, kc, vc, slots)
        cl().paged_attention(q, kc, vc, tables, ctx, 0.1)
    finally:
        torch.cuda.set_sync_debug_mode("default")


@pytest.mark.parametrize("num_splits", [0, 2, 7, 64, 120])
def test_tickets_match_reduce_kernel(num_splits, monkeypatch):
    """Splits combined by the last CTA (tickets, one launch) give the bits of the separate reduce kernel,
    launch after launch (every ticket is left at zero). The reduce kernel stages the partials in shared memory
    (attn_combine.cuh) where nsplit x (D + 2) floats fit 48 KB, and loops over global memory otherwise (120
    splits at D = 128): both against the tickets' loop."""
    for lens, hq, hkv, d, tq, page in (([1, 17, 300, 2000], 32, 8, 128, 1, 16), ([0, 3, 900], 9, 3, 64, 3, 16),
                                       ([5000, 60], 32, 8, 128, 1, 256)):
        kc, vc, tables, ctx, _ = build(lens, hkv, d, page)
        q = torch.randn(len(lens), tq, hq, d, device=DEV).half()
        monkeypatch.setenv("EXL2_BACKEND_ATTN_TICKETS", "0")
        want = cl().paged_attention(q, kc, vc, tables, ctx, 0.1, num_splits)
        monkeypatch.setenv("EXL2_BACKEND_ATTN_TICKETS", "1")
        for _ in range(3):
            assert_exact(cl().paged_attention(q, kc, vc, tables, ctx, 0.1, num_splits), want,
                         f"tickets vs reduce kernel lens={lens} splits={num_splits}")
        for t in cl()._tickets.values():
            assert int(t.count_nonzero()) == 0, "tickets left at zero"
