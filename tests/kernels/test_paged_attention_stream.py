"""The streamed decode attention (csrc/layers/paged_attention_stream.cu, ops/cuda_layers.ATTN_STREAM) against the
reference, with the tolerance of test_paged_attention.check (2x fp16 SDPA's error + 2e-3) for fp16 pages and of
test_kv_quant_kernels.check for code pages. Its shapes:
decode steps (Tq = 1), head_dim 128, 1 / 2 / 4 query heads per kv head over 2 / 4 / 8 kv heads (1, 2 or 4 warps per
kv head); chunks of 16 tokens within pages of 16..256; splits of 16+ keys (the last chunk of a split partial, its
unused slots NaN in build()); one split (the output written by the kernel) or many (the reduce launch). Graph replay,
determinism and strided q run through the `stream` cases of test_paged_attention.py's and test_kv_quant_kernels.py's
kernel fixtures."""

from __future__ import annotations

import pytest
import torch

from tests.kernels.test_paged_attention import DEV, check, cl

pytestmark = pytest.mark.cuda


@pytest.fixture(autouse=True)
def streamed(monkeypatch):
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("the streamed kernel needs sm_90+")
    monkeypatch.setattr(cl(), "ATTN_STREAM", True)


@pytest.mark.parametrize("hq,hkv", [(64, 8), (32, 8), (16, 8), (8, 8), (16, 4), (8, 4), (8, 2), (4, 2), (2, 2)])
@pytest.mark.parametrize("page", [16, 256])
def test_shapes_it_takes(hq, hkv, page):
    """8 kv heads: the tensor-core kernel (paged_attention_stream_mma.cu; 64 / 8 the 70B's 8 query heads per kv
    head); 2 and 4: the CUDA-core one."""
    assert cl().attn_streamed((1, 1, hq, 128), (1, page, hkv, 128), torch.device(DEV))
    check([1, 15, 16, 17, 31, 33, 255, 256, 257, 1000, 4097], 1, hq, hkv, 128, page=page)


@pytest.mark.parametrize("num_splits", [1, 2, 3, 16, 64, 132])
def test_forced_splits(num_splits):
    """One split: the kernel normalizes and writes the output; more: partials and the reduce launch (132: the
    staged reduce past 48 KB of shared memory)."""
    check([1, 17, 300, 2000, 9000], 1, 32, 8, 128, page=16, num_splits=num_splits)


@pytest.mark.parametrize("min_split", [16, 32, 64, 512])
def test_min_split(monkeypatch, min_split):
    monkeypatch.setattr(cl(), "ATTN_STREAM_MIN_SPLIT", min_split)
    check([5, 100, 1024, 7000], 1, 32, 8, 128, page=64)


def test_long_context_and_batch():
    check([32768], 1, 32, 8, 128, page=256)
    check([70, 20000, 3, 8191], 1, 32, 8, 128, page=256, seed=1)


def test_empty_context_gives_zeros():
    out = check([0, 3], 1, 32, 8, 128, num_splits=1)
    assert torch.all(out[0] == 0)
    out = check([0, 3000], 1, 32, 8, 128)
    assert torch.all(out[0] == 0)


def test_shapes_it_declines_take_the_default_route(monkeypatch):
    """Head_dim 64, G = 8 over fewer than 8 kv heads, one kv head, and verify rows (Tq > 1) with
    ATTN_STREAM_VERIFY off are not its shapes: the default kernels run them. Verify rows up to 64 per kv head are
    its shapes by default (H100 call AY1)."""
    dev = torch.device(DEV)
    for q_shape, cache_shape in (((1, 1, 32, 64), (1, 16, 8, 64)), ((1, 1, 32, 128), (1, 16, 4, 128)),
                                 ((1, 1, 8, 128), (1, 16, 1, 128))):
        assert not cl().attn_streamed(q_shape, cache_shape, dev)
    assert cl().attn_streamed((1, 5, 32, 128), (1, 16, 8, 128), dev) == cl().ATTN_STREAM_VERIFY
    assert not cl().attn_streamed((1, 17, 32, 128), (1, 16, 8, 128), dev)  # 68 rows per kv head: past 4 tiles
    monkeypatch.setattr(cl(), "ATTN_STREAM_VERIFY", False)
    assert not cl().attn_streamed((1, 5, 32, 128), (1, 16, 8, 128), dev)
    check([300, 2000], 5, 32, 8, 128, page=64)
    check([300, 2000], 1, 32, 4, 128, page=64)
    check([33, 900], 1, 8, 1, 128, page=16)


@pytest.mark.parametrize("hq", [32, 64])
@pytest.mark.parametrize("num_splits", [1, 2, 5, 132])
def test_tensor_core_kernel_alone(monkeypatch, hq, num_splits):
    """ATTN_STREAM_FP16 alone: fp16 pages over 8 kv heads take the tensor-core streamed kernel (one split writing
    the output, or partials and the reduce), every other shape its default route; chunks cut short by the split's
    end (their V rows NaN in build()) and contexts of 1..15 keys."""
    monkeypatch.setattr(cl(), "ATTN_STREAM", False)
    monkeypatch.setattr(cl(), "ATTN_STREAM_FP16", True)
    assert cl().attn_streamed((1, 1, hq, 128), (1, 16, 8, 128), torch.device(DEV))
    assert not cl().attn_streamed((1, 1, 16, 128), (1, 16, 4, 128), torch.device(DEV))
    check([1, 2, 15, 16, 17, 47, 300, 4097], 1, hq, 8, 128, page=16, num_splits=num_splits)
    check([9000, 31], 1, hq, 8, 128, page=256, num_splits=num_splits, seed=1)
    check([700, 20], 1, 16, 4, 128, page=64)


def test_library_rejects_shapes_it_does_not_take():
    """The C entry checks the shapes itself (flags bit 9 from a caller that did not ask attn_streamed): a verify
    step's rows over 4 kv heads, head_dim 64 and a cache not 16-byte aligned give a typed error naming the kernel,
    before any launch."""
    import math

    from exl2_backend.errors import KernelUnavailableError
    from tests.kernels.test_paged_attention import build

    for tq, hkv, d in ((2, 4, 128), (1, 8, 64)):  # verify rows over 4 kv heads; head_dim 64
        kc, vc, tables, ctx, _ = build([40, 300], hkv, d, 16)
        q = torch.randn(2, tq, 4 * hkv, d, device=DEV).half()
        q, tables, ctx = cl()._attention_inputs("paged_attention", q, tables, ctx)
        out = torch.empty_like(q)
        ws = torch.empty(2 * tq * 32 * 4 * (d + 2), device=DEV)
        with pytest.raises(KernelUnavailableError, match="stream"):
            cl()._launch_paged_attention(q, kc, vc, tables, ctx, out, ws, 4, 1 / math.sqrt(d), None, streamed=True)
    # A cache that starts 8 bytes past a 16-byte boundary: bulk copies would fault (a sticky error ending the
    # context); the entry refuses it instead, and the context still runs the next launch.
    kc, vc, tables, ctx, _ = build([40, 300], 8, 128, 16)
    shifted = torch.empty(kc.numel() + 4, dtype=kc.dtype, device=DEV)[4:].view(kc.shape).copy_(kc)
    assert shifted.data_ptr() % 16 == 8
    q = torch.randn(2, 1, 32, 128, device=DEV).half()
    q, tables, ctx = cl()._attention_inputs("paged_attention", q, tables, ctx)
    out = torch.empty_like(q)
    ws = torch.empty(2 * 32 * 4 * 130, device=DEV)
    with pytest.raises(KernelUnavailableError, match="16-byte aligned"):
        cl()._launch_paged_attention(q, shifted, vc, tables, ctx, out, ws, 4, 1 / math.sqrt(128), None,
                                     streamed=True)
    check([40, 300], 1, 32, 8, 128, page=16)


@pytest.mark.parametrize("kf,vf", [("e4m3", "e4m3"), ("int8", "int8"), ("int8", "int4"), ("int4", "int4")])
@pytest.mark.parametrize("hq,hkv", [(32, 8), (8, 4), (4, 2)])
def test_code_pages(kf, vf, hq, hkv):
    """Quantized pages (fp8 / q8 / q6 / q4) against the reference over the dequantized pages, with the tolerance of
    test_kv_quant_kernels.check: codes and group scales in the ring, q rotated once for the rotated formats, V's sums
    rotated back by the reduce, or by the kernel itself with one split."""
    from tests.kernels.test_kv_quant_kernels import check as check_codes

    assert cl().attn_streamed((1, 1, hq, 128), (1, 16, hkv, 128), torch.device(DEV))
    check_codes([1, 17, 255, 257, 1000, 4097], 1, hq, hkv, 128, kf, vf, page=16)
    check_codes([3000, 40], 1, hq, hkv, 128, kf, vf, page=256, num_splits=1)
    check_codes([3000, 40], 1, hq, hkv, 128, kf, vf, page=64, num_splits=132)


@pytest.mark.parametrize("tq,hq", [(2, 32), (5, 32), (9, 32), (16, 32), (3, 64), (8, 64)])
@pytest.mark.parametrize("num_splits", [0, 1, 7])
def test_verify_rows(monkeypatch, tq, hq, num_splits):
    """ATTN_STREAM_VERIFY: verify steps (Tq query rows per sequence, each seeing the keys up to its own position)
    on the tensor-core kernel, G x Tq rows per kv head in tiles of 16 (grid z; 8 rows with one half for 2 x 4):
    1-4 tiles, contexts shorter than Tq (the first rows see no key: zeros), partial chunks, one split or many."""
    monkeypatch.setattr(cl(), "ATTN_STREAM", False)
    monkeypatch.setattr(cl(), "ATTN_STREAM_FP16", True)
    monkeypatch.setattr(cl(), "ATTN_STREAM_VERIFY", True)
    assert cl().attn_streamed((1, tq, hq, 128), (1, 16, 8, 128), torch.device(DEV))
    check([1, 3, 17, 300, 2000], tq, hq, 8, 128, page=16, num_splits=num_splits)
    check([5000, 40], tq, hq, 8, 128, page=256, num_splits=num_splits, seed=1)


@pytest.mark.parametrize("min_split", [16, 48, 4096])
def test_verify_min_split(monkeypatch, min_split):
    """The verify steps' own shortest split (ATTN_STREAM_VERIFY_MIN_SPLIT, rows past 8 per kv head): the kernel
    cuts each context by it at run time (4096: one split for these contexts)."""
    monkeypatch.setattr(cl(), "ATTN_STREAM_VERIFY", True)
    monkeypatch.setattr(cl(), "ATTN_STREAM_VERIFY_MIN_SPLIT", min_split)
    check([5, 100, 1024, 7000], 5, 32, 8, 128, page=64)
