"""CUDA quantized KV cache kernels against ops/reference_kvquant.py.

Write kernel (csrc/layers/kv_quant.cu): codes and scales must equal the reference bit for bit (integer work),
for fp16 and bf16 inputs, strided views, padded slots; the fused RoPE variant equals the CUDA apply_rope kernel
followed by the reference quantizer (rope_kv_write's own contract: the same bits as the unfused ops), and q
is rotated exactly as apply_rope.

Attention kernel (csrc/layers/paged_attention_quant.cu): compared with reference.paged_attention over the
dequantized pages in fp32 (same function of the stored codes), tolerance of tests/kernels/test_paged_attention.py:
max error <= 2 x the error of fp16 SDPA on the same dequantized K/V, + 2e-3.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from exl2_backend.cache.kv_types import FORMATS
from exl2_backend.ops import reference
from exl2_backend.ops import reference_kvquant as R
from tests.helpers.tolerances import assert_close_rel, assert_exact

pytestmark = pytest.mark.cuda

DEV = "cuda"
PAIRS = [("e4m3", "e4m3"), ("int8", "int8"), ("int8", "int4"), ("int4", "int4")]  # fp8, q8, q6, q4


def kq():
    from exl2_backend.ops import cuda_kvquant

    return cuda_kvquant


def empty_cache(p, s, hkv, d, kf, vf, fill=0):
    """Code/scale caches with garbage in every slot (writes must cover exactly their slots)."""
    kc = torch.full((p, s, hkv, FORMATS[kf].code_bytes(d)), fill, dtype=torch.uint8, device=DEV)
    vc = torch.full((p, s, hkv, FORMATS[vf].code_bytes(d)), fill, dtype=torch.uint8, device=DEV)
    ks = torch.full((p, s, hkv, d // 32), 7.0, dtype=torch.float16, device=DEV)
    vs = torch.full_like(ks, 7.0)
    return kc, ks, vc, vs


def ref_write(k, v, caches, slots, kf, vf):
    """The reference on CPU copies (CPU torch: IEEE division everywhere), copied back."""
    host = [t.cpu() for t in caches]
    R.kv_quant_write(k.cpu(), v.cpu(), *host, slots.cpu(), kf, vf)
    return [t.to(DEV) for t in host]


def kv_like(t, h, d, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, h, d, generator=g)
    x[..., 5] *= 10  # an outlier channel
    x[: t // 3] *= 1e-3  # small rows (e4m3 subnormals after scaling)
    return x.to(dtype).to(DEV)


@pytest.mark.parametrize("kf,vf", PAIRS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("hkv,d", [(1, 32), (3, 64), (8, 128), (2, 256)])
def test_write_exact_codes(kf, vf, dtype, hkv, d):
    t, p, s = 37, 6, 16
    k, v = kv_like(t, hkv, d, dtype, 0), kv_like(t, hkv, d, dtype, 1)
    slots = torch.randperm(p * s)[:t].to(DEV)
    slots[3], slots[10] = -1, p * s + 5  # padding rows and past-the-cache slots write nothing
    caches = empty_cache(p, s, hkv, d, kf, vf, fill=0xAB)
    want = ref_write(k, v, caches, torch.where(slots >= p * s, -1, slots), kf, vf)
    kq().kv_quant_write(k, v, *caches, slots, kf, vf)
    for name, a, b in zip(("k codes", "k scales", "v codes", "v scales"), caches, want):
        assert_exact(a, b, f"{name} {kf}/{vf} {dtype} {hkv}x{d}")


def test_write_strided_views_of_a_qkv_output():
    t, hq, hkv, d = 9, 8, 2, 128
    qkv = torch.randn(t, (hq + 2 * hkv) * d, device=DEV).half()
    k = qkv[:, hq * d : (hq + hkv) * d].view(t, hkv, d)
    v = qkv[:, (hq + hkv) * d :].view(t, hkv, d)
    slots = torch.arange(t, device=DEV) * 3
    for kf, vf in PAIRS:
        caches = empty_cache(4, 16, hkv, d, kf, vf)
        want = ref_write(k.contiguous(), v.contiguous(), caches, slots, kf, vf)
        kq().kv_quant_write(k, v, *caches, slots, kf, vf)
        for a, b in zip(caches, want):
            assert_exact(a, b, f"strided {kf}/{vf}")


@pytest.mark.parametrize("kf,vf", PAIRS)
def test_fused_rope_write_equals_rope_kernel_then_reference_quantizer(kf, vf):
    from exl2_backend.ops import cuda_layers

    t, hq, hkv, d = 11, 8, 2, 128
    qkv = torch.randn(t, (hq + 2 * hkv) * d, device=DEV).half()
    q = qkv[:, : hq * d].view(t, hq, d)
    k = qkv[:, hq * d : (hq + hkv) * d].view(t, hkv, d)
    v = qkv[:, (hq + hkv) * d :].view(t, hkv, d)
    pos = torch.tensor([0, 1, 2, 100, 1000, 4095, 4096, 9999, 31, 32, 65535], device=DEV)
    inv = reference.rope_inv_freq(d, 500000.0).to(DEV)
    slots = torch.arange(t, device=DEV) + 5
    slots[2] = -1
    q_want = cuda_layers.apply_rope(q, pos, inv)
    k_rot = cuda_layers.apply_rope(k, pos, inv)
    caches = empty_cache(2, 16, hkv, d, kf, vf)
    want = ref_write(k_rot, v.contiguous(), caches, slots, kf, vf)
    kq().rope_kv_quant_write(q, k, v, pos, inv, *caches, slots, kf, vf)
    assert_exact(q, q_want, "q rotated in place")
    for a, b in zip(caches, want):
        assert_exact(a, b, f"rope write {kf}/{vf}")


def test_write_many_tokens_prefill_chunk():
    t, hkv, d = 2048, 8, 128
    k, v = kv_like(t, hkv, d, torch.float16, 3), kv_like(t, hkv, d, torch.float16, 4)
    slots = torch.randperm(160 * 16)[:t].to(DEV)
    caches = empty_cache(160, 16, hkv, d, "int4", "int4")
    want = ref_write(k, v, caches, slots, "int4", "int4")
    kq().kv_quant_write(k, v, *caches, slots, "int4", "int4")
    for a, b in zip(caches, want):
        assert_exact(a, b, "2048-token write")


# --- attention ------------------------------------------------------------------------------------------------


@pytest.fixture(params=["mma", "mma_online", "mma_online2", "staged", "staged3", "staged_tiles", "cuda_core",
                        "stream"])
def attn_kernel(request, monkeypatch):
    """Every attention kernel: the tensor-core one with two passes, its one-pass variants in registers
    (cuda_layers.ATTN_MMA_ONLINE 1: one step of keys in flight per warp; 2: two) and with 2 or 3 steps staged in
    shared memory (ATTN_STAGED; 2 stages the default for code pages), one row tile per CTA or several sharing rings
    (ATTN_SHARED_TILES, the default for more than 8 rows per kv head), the CUDA-core one; and the streamed kernel
    (ATTN_STREAM: decode steps of the shapes it takes, the others on the default route)."""
    from exl2_backend.ops import cuda_layers

    monkeypatch.setattr(cuda_layers, "ATTN_STREAM", request.param == "stream")
    if request.param == "stream":
        return request.param

    monkeypatch.setattr(kq(), "ATTN_QUANT_MMA", request.param != "cuda_core")
    online = {"mma_online": 1, "mma_online2": 2, "staged": 2, "staged3": 2, "staged_tiles": 2}.get(request.param, 0)
    monkeypatch.setattr(cuda_layers, "ATTN_MMA_ONLINE", online)
    staged = {"staged": "2", "staged3": "3", "staged_tiles": "2"}.get(request.param, "0")
    monkeypatch.setattr(cuda_layers, "ATTN_STAGED", staged)
    monkeypatch.setattr(cuda_layers, "ATTN_SHARED_TILES", request.param == "staged_tiles")
    return request.param


def build(lens, hkv, d, page, kf, vf, seed=0, spare=5, k_ramp=None):
    """Random K/V per sequence quantized into shuffled pages; unused slots hold garbage codes and NaN scales and
    unused table entries garbage, so any read outside the context shows up. k_ramp(n) -> [n]: each position's K
    multiplier (None: 1)."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    need = [max(1, -(-n // page)) for n in lens]
    num_pages = sum(need) + spare
    kc, ks, vc, vs = empty_cache(num_pages, page, hkv, d, kf, vf, fill=0x77)
    ks.fill_(float("nan"))
    vs.fill_(float("nan"))
    order = torch.randperm(num_pages, generator=g).tolist()
    tables = torch.full((len(lens), max(need) + 2), -1, dtype=torch.int32)
    tables[:, -1] = 10**6
    for b, n in enumerate(lens):
        pages = [order.pop() for _ in range(need[b])]
        tables[b, : need[b]] = torch.tensor(pages, dtype=torch.int32)
        k = torch.randn(n, hkv, d, generator=g)
        k[..., 3] *= 8
        if k_ramp is not None:
            k *= k_ramp(n)[:, None, None]
        v = torch.randn(n, hkv, d, generator=g)
        pos = torch.arange(n)
        slots = (torch.tensor(pages)[pos // page] * page + pos % page).to(DEV)
        kq().kv_quant_write(k.half().to(DEV), v.half().to(DEV), kc, ks, vc, vs, slots, kf, vf)
    return (kc, ks, vc, vs), tables.to(DEV), torch.tensor(lens, dtype=torch.int32, device=DEV)


def sdpa_fp16(q, kd, vd, tables, lens, scale):
    """fp16 SDPA per sequence over the dequantized pages (GQA expanded, causal by absolute position)."""
    b_, tq, hq, d = q.shape
    s, hkv = kd.shape[1], kd.shape[2]
    out = torch.zeros_like(q)
    for b in range(b_):
        n = int(lens[b])
        if n <= 0:
            continue
        pages = tables[b, : -(-n // s)].long()
        k = kd.index_select(0, pages).reshape(-1, hkv, d)[:n].half()
        v = vd.index_select(0, pages).reshape(-1, hkv, d)[:n].half()
        kk = k.repeat_interleave(hq // hkv, dim=1).transpose(0, 1)[None]
        vv = v.repeat_interleave(hq // hkv, dim=1).transpose(0, 1)[None]
        mask = torch.arange(n, device=DEV)[None, :] <= (torch.arange(tq, device=DEV) + n - tq)[:, None]
        o = F.scaled_dot_product_attention(q[b].transpose(0, 1)[None], kk, vv, attn_mask=mask, scale=scale)
        out[b] = torch.where(mask.any(-1)[:, None, None], o[0].transpose(0, 1), torch.zeros_like(o[0].transpose(0, 1)))
    return out


def check(lens, tq, hq, hkv, d, kf, vf, page=16, num_splits=0, seed=0, q=None, k_ramp=None):
    caches, tables, ctx = build(lens, hkv, d, page, kf, vf, seed, k_ramp=k_ramp)
    if q is None:
        q = torch.randn(len(lens), tq, hq, d, device=DEV).half()
    scale = 1 / math.sqrt(d)
    out = kq().paged_attention_quant(q, *caches, tables, ctx, scale, kf, vf, num_splits)
    kd, vd, tab = R.gather_dequantized(*caches, tables, ctx, kf, vf)  # fp32 pages actually read
    ref = reference.paged_attention(q.float(), kd, vd, tab, ctx, scale)
    base = sdpa_fp16(q.contiguous(), kd, vd, tab, ctx, scale)
    assert_close_rel(out, ref, base, msg=f"{kf}/{vf} lens={lens} tq={tq} {hq}/{hkv}x{d} page={page} "
                                          f"splits={num_splits}")
    return out


@pytest.mark.parametrize("kf,vf", PAIRS)
@pytest.mark.parametrize("n", [1, 15, 16, 17, 255, 257, 1000, 8193])
@pytest.mark.parametrize("hq,hkv,d", [(9, 3, 64), (32, 8, 128)])
@pytest.mark.usefixtures("attn_kernel")
def test_single_sequence(kf, vf, n, hq, hkv, d):
    check([n], 1, hq, hkv, d, kf, vf, page=256 if n >= 1000 else 16)


@pytest.mark.parametrize("kf,vf", PAIRS)
@pytest.mark.parametrize("page", [16, 64, 256])
@pytest.mark.usefixtures("attn_kernel")
def test_batch_of_lengths(kf, vf, page):
    g = torch.Generator().manual_seed(3)
    lens = torch.randint(1, 1500, (16,), generator=g).tolist()
    lens[0], lens[1], lens[2] = 1, 256, 4097
    check(lens, 1, 32, 8, 128, kf, vf, page=page)
    check(lens[:7], 4, 9, 3, 64, kf, vf, page=page, seed=1)


@pytest.mark.parametrize("kf,vf", PAIRS)
@pytest.mark.parametrize("num_splits", [1, 2, 7, 64, 120])
@pytest.mark.usefixtures("attn_kernel")
def test_forced_splits(kf, vf, num_splits):
    # 120 splits x (128 + 2) floats pass the reduce's 48 KB staging (its global-memory loop); at D = 64 they fit
    lens = [1, 17, 300, 2000] if num_splits > 1 else [1, 17, 300, 900]  # one split holds <= 1024 keys
    check(lens, 1, 32, 8, 128, kf, vf, num_splits=num_splits)
    check(lens, 3, 9, 3, 64, kf, vf, num_splits=num_splits)


@pytest.mark.parametrize("kf,vf", PAIRS)
@pytest.mark.parametrize("tq,hq,hkv", [(16, 32, 8), (16, 9, 3), (2, 64, 8), (1, 8, 8), (3, 16, 8), (7, 32, 8),
                                       (1, 16, 1)])
@pytest.mark.usefixtures("attn_kernel")
def test_row_tiles_and_gqa_ratios(kf, vf, tq, hq, hkv):
    """G * Tq query rows per kv head from 1 to 128 (every row-tile size, several tiles per head); GQA 1 to 16."""
    check([40, 700, 2500], tq, hq, hkv, 128, kf, vf, page=64)
    check([33], tq, hq, hkv, 64, kf, vf, page=16, seed=2)


@pytest.mark.parametrize("kf,vf", PAIRS)
@pytest.mark.parametrize("cap", [4, 8])
def test_row_tile_cap(monkeypatch, kf, vf, cap):
    """ops/cuda_layers.ATTN_MAX_ROW_TILE: a verify step's 20 rows per kv head in 5 tiles of 4 or 3 of 8."""
    from exl2_backend.ops import cuda_layers

    monkeypatch.setattr(cuda_layers, "ATTN_MAX_ROW_TILE", cap)
    monkeypatch.setattr(kq(), "ATTN_QUANT_MMA", False)  # the cap is the CUDA-core kernel's
    check([40, 700, 2500], 5, 32, 8, 128, kf, vf, page=64)
    check([33, 1500], 9, 9, 3, 64, kf, vf, page=16, seed=3)


@pytest.mark.usefixtures("attn_kernel")
@pytest.mark.parametrize("kf,vf", PAIRS)
@pytest.mark.parametrize("mag", [1e-3, 40.0])
def test_magnitudes_far_from_one(kf, vf, mag):
    """Small and large K/V scales (fp16 operands of the tensor-core kernel near their range ends: products of
    probabilities and value scales down to subnormals) and a peaked softmax, against the fp32 reference."""
    caches, tables, ctx = build([3000, 700], 8, 128, 64, kf, vf, seed=4)
    for c in (caches[1], caches[3]):
        c.mul_(mag)  # the scales: the same codes mean mag times the values
    q = (torch.randn(2, 1, 32, 128, device=DEV) * (4.0 / mag if mag > 1 else 1.0)).half()
    scale = 1 / math.sqrt(128)
    out = kq().paged_attention_quant(q, *caches, tables, ctx, scale, kf, vf)
    kd, vd, tab = R.gather_dequantized(*caches, tables, ctx, kf, vf)
    ref = reference.paged_attention(q.float(), kd, vd, tab, ctx, scale)
    base = sdpa_fp16(q.contiguous(), kd, vd, tab, ctx, scale)
    assert_close_rel(out, ref, base, atol=2e-3 * min(1.0, mag), msg=f"{kf}/{vf} magnitude {mag}")


def _rising_keys(n):
    """K multipliers growing along the context, doubled from its middle on: [n]."""
    t = torch.arange(n, dtype=torch.float32)
    return (1 + t / 500) * torch.where(t >= n // 2, 2.0, 1.0)


@pytest.mark.usefixtures("attn_kernel")
@pytest.mark.parametrize("kf,vf", PAIRS)
def test_scores_rising_along_the_context(kf, vf):
    """Keys growing along the context with a jump in the middle: a split's running max rises in small steps and
    past the one-pass kernels' lazy margin (kLazyMaxLog2: the max they keep moves only past 2^8) again and again,
    so probabilities against a stale max reach 256 and rescales come late; against the fp32 reference. Decode and
    verify rows, automatic, single and forced splits (a split holds <= 1024 keys)."""
    check([3000, 700], 1, 32, 8, 128, kf, vf, page=64, k_ramp=_rising_keys)
    check([1000, 17], 5, 32, 8, 128, kf, vf, page=16, num_splits=1, seed=1, k_ramp=_rising_keys)
    check([2500], 3, 9, 3, 64, kf, vf, page=16, num_splits=7, seed=2, k_ramp=_rising_keys)


def test_kernels_agree_closely(monkeypatch):
    """The tensor-core kernel (fp16 operands split in two parts; two passes or one with an online softmax) against
    the CUDA-core kernel (fp32): the same function of the codes to well within fp16 output rounding."""
    from exl2_backend.ops import cuda_layers

    for kf, vf in PAIRS:
        caches, tables, ctx = build([5000, 33, 1200], 8, 128, 64, kf, vf, seed=6)
        q = torch.randn(3, 2, 32, 128, device=DEV).half()
        monkeypatch.setattr(kq(), "ATTN_QUANT_MMA", False)
        want = kq().paged_attention_quant(q, *caches, tables, ctx, 0.09, kf, vf).float()
        monkeypatch.setattr(kq(), "ATTN_QUANT_MMA", True)
        for online in (0, 1, 2):  # two passes; one pass with 1 or 2 steps in flight
            monkeypatch.setattr(cuda_layers, "ATTN_MMA_ONLINE", online)
            out = kq().paged_attention_quant(q, *caches, tables, ctx, 0.09, kf, vf).float()
            err = (out - want).abs().max().item()
            assert err <= 2e-3 * want.abs().max().item(), (kf, vf, online, err)


@pytest.mark.usefixtures("attn_kernel")
def test_short_contexts_give_zeros():
    for kf, vf in PAIRS:
        out = check([0, 2, 5, 100], 5, 9, 3, 64, kf, vf)
        assert torch.all(out[0] == 0) and torch.all(out[1, :3] == 0)
        out = check([0, 3], 1, 32, 8, 128, kf, vf, num_splits=4)
        assert torch.all(out[0] == 0)


@pytest.mark.usefixtures("attn_kernel")
def test_strided_q_from_qkv():
    b, tq, hq, hkv, d = 2, 3, 32, 8, 128
    qkv = torch.randn(b, tq, (hq + 2 * hkv) * d, device=DEV).half()
    q = qkv[..., : hq * d].view(b, tq, hq, d)
    for kf, vf in PAIRS:
        check([50, 3000], tq, hq, hkv, d, kf, vf, page=256, q=q)


@pytest.mark.usefixtures("attn_kernel")
def test_close_to_fp16_cache_attention():
    """End to end: attention over each quantized cache vs the fp16 kernel over the unquantized K/V."""
    from exl2_backend.ops import cuda_layers

    lens, hq, hkv, d, page = [300, 2000], 32, 8, 128, 64
    g = torch.Generator().manual_seed(5)
    kv = [(torch.randn(n, hkv, d, generator=g).half().to(DEV), torch.randn(n, hkv, d, generator=g).half().to(DEV))
          for n in lens]
    tables = torch.arange(2 * 32, dtype=torch.int32, device=DEV).view(2, 32)
    q = torch.randn(2, 1, hq, d, device=DEV).half()
    kc16 = torch.zeros(64, page, hkv, d, dtype=torch.float16, device=DEV)
    vc16 = torch.zeros_like(kc16)
    caches = {pair: empty_cache(64, page, hkv, d, *pair) for pair in PAIRS}
    for b, (k, v) in enumerate(kv):
        pos = torch.arange(k.shape[0], device=DEV)
        slots = tables[b].long()[pos // page] * page + pos % page
        cuda_layers.kv_cache_write(k, v, kc16, vc16, slots)
        for pair, c in caches.items():
            kq().kv_quant_write(k, v, *c, slots, *pair)
    lens_t = torch.tensor(lens, dtype=torch.int32, device=DEV)
    want = cuda_layers.paged_attention(q, kc16, vc16, tables, lens_t, d**-0.5).float()
    for (kf, vf), tol in zip(PAIRS, (0.05, 0.01, 0.12, 0.15)):
        out = kq().paged_attention_quant(q, *caches[(kf, vf)], tables, lens_t, d**-0.5, kf, vf).float()
        rel = float((out - want).norm() / want.norm())
        assert rel < tol, (kf, vf, rel)


@pytest.mark.usefixtures("attn_kernel")
def test_deterministic():
    caches, tables, ctx = build([5000, 7000], 8, 128, 256, "int4", "int4")
    q = torch.randn(2, 1, 32, 128, device=DEV).half()
    a = kq().paged_attention_quant(q, *caches, tables, ctx, 0.1, "int4", "int4")
    for _ in range(3):
        assert_exact(kq().paged_attention_quant(q, *caches, tables, ctx, 0.1, "int4", "int4"), a, "run to run")


@pytest.mark.usefixtures("attn_kernel")
def test_cuda_graph_replay():
    """Write + attention captured once with a fixed table width; replays see new lengths, slots and queries."""
    hq, hkv, d, page = 32, 8, 128, 256
    caches, tables, ctx = build([3000, 9000], hkv, d, page, "int8", "int4")
    q = torch.randn(2, 1, hq, d, device=DEV).half()
    k = torch.randn(2, hkv, d, device=DEV).half()
    slots = torch.tensor([-1, -1], device=DEV)

    def step():
        kq().kv_quant_write(k, k, *caches, slots, "int8", "int4")
        return kq().paged_attention_quant(q, *caches, tables, ctx, 0.08, "int8", "int4")

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        step()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = step()
    for lens in ([3000, 9000], [1, 8999], [2999, 257]):
        ctx.copy_(torch.tensor(lens, dtype=torch.int32))
        q.copy_(torch.randn_like(q))
        g.replay()
        torch.cuda.synchronize()
        assert_exact(out, kq().paged_attention_quant(q, *caches, tables, ctx, 0.08, "int8", "int4"),
                     f"replay lens={lens}")


def test_fallbacks_and_errors():
    from exl2_backend.errors import InvalidRequestError

    caches, tables, ctx = build([40], 2, 96, 16, "int8", "int8")  # head_dim 96: reference on the GPU
    q = torch.randn(1, 1, 4, 96, device=DEV).half()
    out = kq().paged_attention_quant(q, *caches, tables, ctx, 0.1, "int8", "int8")
    torch.testing.assert_close(out, R.paged_attention_quant(q, *caches, tables, ctx, 0.1, "int8", "int8"))
    bad_pair = empty_cache(4, 16, 2, 96, "int4", "int8")
    with pytest.raises(InvalidRequestError, match="format pair"):
        kq().paged_attention_quant(q, *bad_pair, tables, ctx, 0.1, "int4", "int8")
    with pytest.raises(InvalidRequestError, match="must be"):
        kq().paged_attention_quant(q, *caches, tables, ctx, 0.1, "int4", "int4")  # code width mismatch


@pytest.mark.parametrize("op", ["fp16", "quant"])
def test_shared_argument_errors(op):
    """Both paged-attention ops refuse the same bad arguments with InvalidRequestError naming the field."""
    from exl2_backend.errors import InvalidRequestError
    from exl2_backend.ops import cuda_layers

    caches, tables, ctx = build([40, 7], 2, 64, 16, "int8", "int8")
    kc16 = torch.zeros(caches[0].shape[0], 16, 2, 64, dtype=torch.float16, device=DEV)

    def call(q, tables=tables, ctx=ctx, num_splits=0):
        if op == "quant":
            return kq().paged_attention_quant(q, *caches, tables, ctx, 0.1, "int8", "int8", num_splits)
        return cuda_layers.paged_attention(q, kc16, kc16, tables, ctx, 0.1, num_splits)

    q = torch.randn(2, 1, 4, 64, device=DEV).half()
    cases = [
        ({"q": torch.randn(2, 1, 4, 128, device=DEV).half()}, "head_dim"),
        ({"q": torch.randn(2, 1, 3, 64, device=DEV).half()}, "not a multiple"),
        ({"q": q, "tables": tables[:1]}, "block_tables must be"),
        ({"q": q, "tables": tables[:, 0]}, "block_tables must be"),
        ({"q": q, "ctx": ctx[:1]}, "context_lens must be"),
        ({"q": q, "ctx": ctx[:, None]}, "context_lens must be"),
        ({"q": q, "num_splits": -1}, "num_splits"),
        ({"q": q, "tables": tables[:, :0]}, "no columns"),
    ]
    for kwargs, match in cases:
        with pytest.raises(InvalidRequestError, match=match):
            call(**kwargs)


def test_misaligned_q_is_copied():
    """q two bytes past a 16-byte boundary (a slice of a wider buffer) gives the aligned q's output."""
    caches, tables, ctx = build([300, 20], 8, 128, 16, "int4", "int4")
    buf = torch.randn(2 * 32 * 128 + 1, device=DEV).half()
    q = buf[1:].view(2, 1, 32, 128)
    assert q.data_ptr() % 16
    out = kq().paged_attention_quant(q, *caches, tables, ctx, 0.08, "int4", "int4")
    torch.testing.assert_close(out, kq().paged_attention_quant(q.clone(), *caches, tables, ctx, 0.08, "int4", "int4"),
                               rtol=0, atol=0)


def test_opcheck():
    caches, tables, ctx = build([20, 300], 3, 64, 16, "int8", "int4")
    q = torch.randn(2, 2, 9, 64, device=DEV).half()
    torch.library.opcheck(torch.ops.exl2_backend.paged_attention_quant.default,
                          (q, *caches, tables, ctx, 0.125, "int8", "int4"))
    k = torch.randn(3, 3, 64, device=DEV).half()
    torch.library.opcheck(torch.ops.exl2_backend.kv_quant_write.default,
                          (k, k, *caches, torch.tensor([0, 5, 17], device=DEV), "int8", "int4"))


def test_no_host_sync():
    caches, tables, ctx = build([100, 5000], 8, 128, 256, "int4", "int4")
    q = torch.randn(2, 1, 32, 128, device=DEV).half()
    k = torch.randn(2, 8, 128, device=DEV).half()
    slots = torch.tensor([3, 700], device=DEV)
    kq().paged_attention_quant(q, *caches, tables, ctx, 0.1, "int4", "int4")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        kq().kv_quant_write(k, k, *caches, slots, "int4", "int4")
        kq().paged_attention_quant(q, *caches, tables, ctx, 0.1, "int4", "int4")
    finally:
        torch.cuda.set_sync_debug_mode("default")


def test_prefill_path_over_quantized_history():
    """More than 16 queries per sequence: dequantized key blocks + SDPA, same semantics as the reference."""
    from exl2_backend import ops

    caches, tables, ctx = build([700, 100], 8, 128, 64, "int8", "int4")
    q = torch.randn(2, 64, 32, 128, device=DEV).half()
    out = ops.paged_attention_quant(q, *caches, tables, ctx, 0.09, "int8", "int4")
    kd, vd, tab = R.gather_dequantized(*caches, tables, ctx, "int8", "int4")
    ref = reference.paged_attention(q.float(), kd, vd, tab, ctx, 0.09)
    base = sdpa_fp16(q, kd, vd, tab, ctx, 0.09)
    assert_close_rel(out, ref, base, msg="prefill over quantized history")


# --- dequantized pages (prefill over a quantized history) ------------------------------------------------------


@pytest.mark.parametrize("fmt", ["e4m3", "int8", "int4"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("hkv,d,page", [(1, 32, 16), (3, 64, 16), (8, 128, 64), (2, 256, 16)])
def test_dequantize_pages_kernel_equals_reference(monkeypatch, fmt, dtype, hkv, d, page):
    """csrc/layers/kv_dequant.cu: the reference's dequantize_pages bit for bit (integer decode, one fp32 multiply,
    the reference's WHT butterfly, one rounding), for pages in any order, repeated, and out-of-range indices
    clamped like the attention kernels."""
    monkeypatch.setattr(kq(), "KV_DEQUANT_KERNEL", True)
    num_pages = 7
    caches = empty_cache(num_pages, page, hkv, d, fmt, fmt)
    t = num_pages * page
    kq().kv_quant_write(kv_like(t, hkv, d, torch.float16, 11), kv_like(t, hkv, d, torch.float16, 12), *caches,
                        torch.arange(t, device=DEV), fmt, fmt)
    codes, scales = caches[0], caches[1]
    pages = torch.tensor([3, 0, 6, 6, 1, 5, 2, 4], device=DEV)
    got = kq().dequantize_pages(codes, scales, pages, fmt, dtype)
    want = R.dequantize_pages(codes, scales, pages, fmt, dtype)
    assert_exact(got, want, f"{fmt} {dtype} {hkv}x{d}")
    odd = kq().dequantize_pages(codes, scales, torch.tensor([-1, num_pages + 3], device=DEV), fmt, dtype)
    assert_exact(odd, R.dequantize_pages(codes, scales, torch.tensor([0, num_pages - 1], device=DEV), fmt, dtype),
                 "clamped pages")
    assert kq().dequantize_pages(codes, scales, pages[:0], fmt, dtype).shape == (0, page, hkv, d)


def test_dequantize_pages_kernel_rejects_mismatched_caches(monkeypatch):
    """Codes whose row width does not match the scales' head_dim (or the format) are a typed error."""
    from exl2_backend.errors import InvalidRequestError

    monkeypatch.setattr(kq(), "KV_DEQUANT_KERNEL", True)
    codes, scales = empty_cache(3, 16, 2, 64, "int8", "int8")[:2]
    with pytest.raises(InvalidRequestError, match="do not match"):
        kq().dequantize_pages(codes, scales, torch.tensor([0], device=DEV), "int4", torch.float16)
    with pytest.raises(InvalidRequestError, match="do not match"):
        narrow = codes[..., :32].contiguous()
        kq().dequantize_pages(narrow, scales, torch.tensor([0], device=DEV), "int8", torch.float16)


def test_prefill_over_quantized_history_with_the_dequant_kernel(monkeypatch):
    """The prefill path (> 32 queries) gives the same bits with the kernel as with the torch dequantization, and
    really launches it (until session 21 dispatch never found the CUDA dequantize_pages, so both runs here took the
    torch ops): the library calls are counted on their way through."""
    from exl2_backend import ops

    caches, tables, ctx = build([700, 100], 8, 128, 64, "int8", "int4")
    q = torch.randn(2, 64, 32, 128, device=DEV).half()
    real_call, launched = kq()._call, []

    def counting_call(name, *args):
        launched.append(name)
        return real_call(name, *args)

    monkeypatch.setattr(kq(), "_call", counting_call)
    outs = []
    for on in (False, True):
        monkeypatch.setattr(kq(), "KV_DEQUANT_KERNEL", on)
        launched.clear()
        outs.append(ops.paged_attention_quant(q, *caches, tables, ctx, 0.09, "int8", "int4"))
        assert ("exl2_kv_dequant_pages" in launched) == on
    assert_exact(outs[1], outs[0], "prefill with the dequant kernel")


_COMBINE_SCRIPT = r"""
import sys
import torch
from tests.kernels import test_kv_quant_kernels as T
from tests.kernels import test_paged_attention as P
from exl2_backend.ops import cuda_layers

torch.manual_seed(0)
outs = []
for kf, vf in T.PAIRS:  # 120 splits of D = 128: 62 KB of partials per row
    caches, tables, ctx = T.build([1, 17, 300, 2000], 8, 128, 16, kf, vf, 0)
    q = torch.randn(4, 1, 32, 128, device="cuda").half()
    outs.append(T.kq().paged_attention_quant(q, *caches, tables, ctx, 0.1, kf, vf, 120).cpu())
kc, vc, tables, ctx, _ = P.build([1, 17, 300, 2000], 8, 128, 16, 0)
q = torch.randn(4, 1, 32, 128, device="cuda").half()
outs.append(cuda_layers.paged_attention(q, kc, vc, tables, ctx, 0.1, 120).cpu())
torch.save(outs, sys.argv[1])
"""


def test_combine_staged_past_48kb_is_bit_identical(tmp_path):
    """EXL2_ATTN_COMBINE_MAX_KB and EXL2_ATTN_REDUCE_SLICE_MIN (read once per process: subprocesses): at 200 the
    reduce kernels stage 62 KB of partials per row through the opt-in attribute (the default); at 48 they loop over
    global memory; with slices, one warp per 32 dims of a row stages its quarter (attn_quant_reduce_slice_kernel).
    Same bits, for every quantized format pair and for fp16 pages."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    got = {}
    for name, setting in (("48", {"EXL2_ATTN_COMBINE_MAX_KB": "48"}), ("200", {"EXL2_ATTN_COMBINE_MAX_KB": "200"}),
                          ("slices", {"EXL2_ATTN_REDUCE_SLICE_MIN": "2"})):
        # The caller's own settings of both switches dropped: "200" must be the default reduce, not slices.
        base = {k: v for k, v in os.environ.items()
                if k not in ("EXL2_ATTN_COMBINE_MAX_KB", "EXL2_ATTN_REDUCE_SLICE_MIN")}
        env = {**base, **setting, "PYTHONPATH": f"{root}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
        out = tmp_path / f"{name}.pt"
        subprocess.run([sys.executable, "-c", _COMBINE_SCRIPT, str(out)], env=env, cwd=root, check=True, timeout=120)
        got[name] = torch.load(out)
    for name in ("48", "slices"):
        for a, b in zip(got[name], got["200"]):
            assert torch.equal(a, b), name


def test_staged_one_pass_kernel_is_bit_identical(monkeypatch):
    """EXL2_ATTN_STAGED (cuda_layers.ATTN_STAGED, passed to the library with each launch) runs the one-pass kernel
    with each warp's steps copied into shared memory (2 or 3 stages) instead of loaded into registers: the same
    steps, values and arithmetic, so the same bits as both register variants (one or two steps in flight) for
    every format pair and fp16 pages, head sizes 128 and 64, one and five queries, one and seven splits (partial
    last steps, warps past the split's end). Also with row tiles sharing rings (ATTN_SHARED_TILES: five queries
    are 20 rows per kv head, three tiles per CTA, at GQA 4 and 15 rows, two tiles, at GQA 3). Explicit splits only:
    the automatic split follows the kernel's CTA target (H200 call AE1 compared automatic splits too, and they
    differed)."""
    from exl2_backend.ops import cuda_layers
    from tests.kernels import test_paged_attention as P

    monkeypatch.setattr(kq(), "ATTN_QUANT_MMA", True)
    monkeypatch.setattr(cuda_layers, "ATTN_FP16_MMA", True)
    lens = [1, 17, 300, 2000, 4111]
    got = {}
    for staged, online, tiles in (("0", 1, False), ("0", 2, False), ("2", 2, False), ("3", 2, False),
                                  ("auto", 2, False), ("2", 2, True), ("auto", 2, True)):
        monkeypatch.setattr(cuda_layers, "ATTN_STAGED", staged)
        monkeypatch.setattr(cuda_layers, "ATTN_MMA_ONLINE", online)
        monkeypatch.setattr(cuda_layers, "ATTN_SHARED_TILES", tiles)
        torch.manual_seed(0)
        outs = []
        for hq, hkv, d in ((32, 8, 128), (9, 3, 64)):
            for kf, vf in PAIRS:
                caches, tables, ctx = build(lens, hkv, d, 16, kf, vf, 0)
                for tq in (1, 5):
                    q = torch.randn(len(lens), tq, hq, d, device=DEV).half()
                    for splits in (1, 7):
                        outs.append(kq().paged_attention_quant(q, *caches, tables, ctx, 0.1, kf, vf, splits))
            kc, vc, tables, ctx, _ = P.build(lens, hkv, d, 16, 0)
            for tq in (1, 5):
                q = torch.randn(len(lens), tq, hq, d, device=DEV).half()
                for splits in (1, 7):
                    outs.append(cuda_layers.paged_attention(q, kc, vc, tables, ctx, 0.1, splits))
        got[staged, online, tiles] = outs
    runs = list(got.values())
    assert len(runs[0]) == 2 * (len(PAIRS) + 1) * 2 * 2
    for name, run in got.items():
        for i, (a, b) in enumerate(zip(runs[0], run)):
            assert torch.equal(a, b), (name, i)


@pytest.mark.parametrize("code", [1 | 2 << 2, 3 | 1 << 2, 3 | 3 << 2 | 2 << 4, 3 | 2 << 4, 16, 64 | 2, 128])
def test_bad_kernel_codes_are_refused_by_the_library(code):
    """exl2_paged_attention_quant's use_mma: stages (bits 2-3) only 2 or 3 and only with a one-pass variant, row
    tiles per CTA (bits 4-5) past one only with 2 stages, the streamed kernel (64) alone, no bits past them. The
    library refuses anything else with its message, launching nothing; three tiles per CTA over a single tile's
    rows run (two tiles empty), and the streamed kernel refuses head_dim 64 (its shapes: D = 128)."""
    from exl2_backend.errors import KernelUnavailableError

    lens = [40]
    caches, tables, ctx = build(lens, 2, 64, 16, "int8", "int8", 0)
    q = torch.randn(1, 1, 4, 64, device=DEV).half()
    out = torch.zeros_like(q)
    tables, ctx = tables.to(DEV), ctx.to(DEV, torch.int32)
    kc, ks, vc, vs = caches
    args = (q.data_ptr(), q.stride(0), q.stride(1), q.stride(2), kc.data_ptr(), ks.data_ptr(), vc.data_ptr(),
            vs.data_ptr(), FORMATS["int8"].abi, FORMATS["int8"].abi, tables.data_ptr(), tables.stride(0),
            ctx.data_ptr(), out.data_ptr(), None, 1, 1, 4, 2, 64, kc.shape[0], 16, tables.shape[1], 1, 64, 0.1, 8)
    with pytest.raises(KernelUnavailableError, match="stages|use_mma|tiles"):
        kq()._call("exl2_paged_attention_quant", *args, code, torch.cuda.current_stream().cuda_stream)
    with pytest.raises(KernelUnavailableError, match="stream"):
        kq()._call("exl2_paged_attention_quant", *args, 64, torch.cuda.current_stream().cuda_stream)
    torch.cuda.synchronize()
    assert not out.any()
    kq()._call("exl2_paged_attention_quant", *args, 3 | 2 << 2 | 3 << 4, torch.cuda.current_stream().cuda_stream)
    assert out.isfinite().all() and out.any()
