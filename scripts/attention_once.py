"""A few launches of the paged decode attention at one context length and cache type (for ncu).

Llama-3.1-8B attention shape (32 query heads, 8 KV heads, head_dim 128), batch 1, one query, pages of 256
filled with random values (fp16) or random codes and scales (quantized types).

    ncu -k regex:paged_attention python3 scripts/attention_once.py --cache-type q8 --context 32768
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from exl2_backend.cache import PagedKVCache
from exl2_backend.ops import dispatch


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cache-type", default="fp16")
    ap.add_argument("--context", type=int, default=32768)
    ap.add_argument("--calls", type=int, default=3)
    ap.add_argument("--device", default="cuda", help="cpu: the reference ops (a check of this script)")
    args = ap.parse_args()
    dev = torch.device(args.device)
    page, hq, hkv, d = 256, 32, 8, 128
    pages = -(-args.context // page)
    cache = PagedKVCache(1, pages, page, hkv, d, torch.float16, dev, args.cache_type)
    g = torch.Generator(device=dev).manual_seed(0)
    for t in [cache.k[0], cache.v[0]] + ([cache.k_scales[0], cache.v_scales[0]] if cache.quantized else []):
        if t.dtype == torch.uint8:
            t.copy_(torch.randint(0, 256, t.shape, generator=g, device=dev, dtype=torch.int32).to(torch.uint8))
        else:
            t.copy_(torch.rand(t.shape, generator=g, device=dev).to(t.dtype) * 0.02)
    q = torch.randn(1, 1, hq, d, generator=g, device=dev).half()
    tables = torch.arange(pages, dtype=torch.int32, device=dev).view(1, pages)
    lens = torch.tensor([args.context], dtype=torch.int32, device=dev)
    for _ in range(args.calls):
        if cache.quantized:
            dispatch.paged_attention_quant(q, cache.k[0], cache.k_scales[0], cache.v[0], cache.v_scales[0], tables,
                                           lens, d**-0.5, cache.k_format, cache.v_format)
        else:
            dispatch.paged_attention(q, cache.k[0], cache.v[0], tables, lens, d**-0.5)
    if dev.type == "cuda":
        torch.cuda.synchronize()


if __name__ == "__main__":
    main()
