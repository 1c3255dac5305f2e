"""Decode attention time by cache type and context split (CTAs per SM the split aims at), batch 1.

Llama-3.1-8B attention shape (32 query heads, 8 KV heads, head_dim 128), one query at `--context` keys, four
layers' caches filled with random values or codes so that a CUDA graph of calls rotating through them reads
past L2. Prints us per call and the read rate over the cache bytes (codes + scales) each call must read.

    python3 scripts/attention_sweep.py [--context 32768] [--types fp16,q8,q4] [--ctas 2,4,8,12] [--hq 32]
        [--json out.json]

--splits 0,66,132 times given split counts instead of CTA targets (0: the route's automatic split), e.g. for the
streamed fp16 kernel (EXL2_BACKEND_ATTN_STREAM=1), whose split is one CTA per SM rather than a CTA target.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from exl2_backend.bench.timing import graph_time_us
from exl2_backend.cache import PagedKVCache
from exl2_backend.ops import cuda_kvquant, cuda_layers
from exl2_backend.ops.cuda_layers import attention_splits

LAYERS = 4
PAGE, HQ, HKV, D = 256, 32, 8, 128


def fill(cache: PagedKVCache, g: torch.Generator) -> None:
    for i in range(LAYERS):
        ts = [cache.k[i], cache.v[i]] + ([cache.k_scales[i], cache.v_scales[i]] if cache.quantized else [])
        for t in ts:
            if t.dtype == torch.uint8:
                t.copy_(torch.randint(0, 256, t.shape, generator=g, device=t.device, dtype=torch.int32).to(torch.uint8))
            else:
                t.copy_(torch.rand(t.shape, generator=g, device=t.device).to(t.dtype) * 0.02)


def layer_bytes(cache: PagedKVCache, context: int) -> int:
    per_slot = sum(t[0, 0].numel() * t.element_size() for t in
                   ([cache.k[0], cache.v[0]] + ([cache.k_scales[0], cache.v_scales[0]] if cache.quantized else [])))
    return per_slot * context


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--context", type=int, default=32768)
    ap.add_argument("--types", default="fp16,q8,q4")
    ap.add_argument("--ctas", default="2,4,8,12")
    ap.add_argument("--splits", help="split counts to time instead of --ctas (0: automatic)")
    ap.add_argument("--hq", type=int, default=HQ, help="query heads over the 8 kv heads (64: the 70B's)")
    ap.add_argument("--json")
    args = ap.parse_args()
    dev = torch.device("cuda")
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    pages = -(-args.context // PAGE)
    tables = torch.arange(pages, dtype=torch.int32, device=dev).view(1, pages)
    lens = torch.tensor([args.context], dtype=torch.int32, device=dev)
    g = torch.Generator(device=dev).manual_seed(0)
    q = torch.randn(1, 1, args.hq, D, generator=g, device=dev).half()
    results = {}
    for ct in args.types.split(","):
        cache = PagedKVCache(LAYERS, pages, PAGE, HKV, D, torch.float16, dev, ct)
        fill(cache, g)
        nbytes = layer_bytes(cache, args.context)
        results[ct] = {}
        # (label, JSON key, splits): by CTA target (key: the target), or by split count (key: "s<count>")
        cells = [(f"splits {int(x)}", f"s{int(x)}", int(x)) for x in args.splits.split(",")] if args.splits else [
            (f"ctas/SM {int(c):>2}", int(c),
             attention_splits(1, 1, args.hq, HKV, args.context, sms, ctas_per_sm=int(c)))
            for c in args.ctas.split(",")]
        for label, c, ns in cells:

            def call(i, ns=ns, cache=cache):
                if cache.quantized:
                    return cuda_kvquant.paged_attention_quant(q, cache.k[i], cache.k_scales[i], cache.v[i],
                                                              cache.v_scales[i], tables, lens, D**-0.5, cache.k_format,
                                                              cache.v_format, ns)
                return cuda_layers.paged_attention(q, cache.k[i], cache.v[i], tables, lens, D**-0.5, ns)

            per = graph_time_us([lambda i=i: call(i) for i in range(LAYERS)] * 3)  # us per call
            results[ct][c] = {"splits": ns, "us": round(per, 2), "gbs": round(nbytes / per / 1e3, 1)}
            print(f"{ct:>5} {label}: {ns:>4} splits  {per:8.2f} us  {nbytes / per / 1e3:7.1f} GB/s", flush=True)
        del cache
        torch.cuda.empty_cache()
    if args.json:
        Path(args.json).write_text(json.dumps({"context": args.context, "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
