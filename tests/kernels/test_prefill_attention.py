"""Blockwise prefill attention (ops/attention_prefill.py) on the GPU against the reference.

Tolerance (tests/helpers/tolerances.py `assert_close_rel`): max |out - ref_fp32| <= 2 x the error of fp16 SDPA
with an explicit causal mask over the whole context (the previous, unblocked implementation) + 2e-3. The
blocked version merges fp16 partial outputs in fp32 by their log-sum-exps. Unused cache slots are NaN and
unused block-table entries garbage (tests/kernels/test_paged_attention.build), so any read past the context
shows up.
"""

from __future__ import annotations

import math

import pytest
import torch

from exl2_backend.ops import reference
from exl2_backend.ops.attention_prefill import prefill_attention
from tests.helpers.tolerances import assert_close_rel
from tests.kernels.test_paged_attention import build, sdpa_fp16

pytestmark = pytest.mark.cuda

DEV = "cuda"


def check(lens, tq, hq, hkv, d, page, key_block, seed=0):
    kc, vc, tables, ctx, kv = build(lens, hkv, d, page, seed)
    q = torch.randn(len(lens), tq, hq, d, generator=torch.Generator().manual_seed(seed + 1)).half().to(DEV)
    scale = 1 / math.sqrt(d)
    out = prefill_attention(q, kc, vc, tables, ctx, scale, key_block=key_block)
    ref = reference.paged_attention(q.float(), kc.float(), vc.float(), tables, ctx, scale)
    base = sdpa_fp16(q, kv, list(lens), scale)
    assert_close_rel(out, ref, base, msg=f"lens={lens} tq={tq} {hq}/{hkv}x{d} page={page} key_block={key_block}")


@pytest.mark.parametrize("tq,lens", [(17, [17]), (17, [40]), (33, [33, 1000]), (100, [257, 100]), (256, [4099])])
@pytest.mark.parametrize("hq,hkv,d", [(9, 3, 64), (32, 8, 128), (8, 8, 128)])
@pytest.mark.parametrize("key_block", [16, 96, 8192])
def test_blocks_match_reference(tq, lens, hq, hkv, d, key_block):
    check(lens, tq, hq, hkv, d, page=16, key_block=key_block)


def test_large_pages_and_odd_history():
    check([2048 + 5, 300, 4096], 300 - 1, 32, 8, 128, page=256, key_block=1024)


def test_fp16_output_dtype_and_strided_q():
    kc, vc, tables, ctx, _ = build([500], 8, 128, 64)
    qkv = torch.randn(1, 64, (32 + 16) * 128, device=DEV).half()
    q = qkv[..., : 32 * 128].view(1, 64, 32, 128)  # a strided view, as the model passes it
    out = prefill_attention(q, kc, vc, tables, ctx, 0.088)
    ref = reference.paged_attention(q.float(), kc.float(), vc.float(), tables, ctx, 0.088)
    assert out.dtype == torch.float16 and torch.isfinite(out).all()
    assert (out.float() - ref).abs().max().item() < 2e-2
