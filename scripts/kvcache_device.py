"""Quantized KV cache on the GPU: attention-kernel bandwidth per cache type, and quality (KL) per cache type on
the default model. Run by scripts/device/kvcache.sh; writes kvcache_attention.json / kvcache_quality.json under
$OUT (or --out).

    python scripts/kvcache_device.py attention [--contexts 8192 32768]
    python scripts/kvcache_device.py quality [--window 2048 --max-tokens 16384]

attention: median µs of CUDA-graph replays of decode attention (Hq 32 / Hkv 8 / D 128, page 256, the Llama-3-8B
layer shape) over caches of each type, rotating over enough page sets that L2 cannot serve a call from the
previous one; GB/s = bytes the type must read (codes + scales of K and V) / time. Also the quantize-on-write
(+RoPE) kernel at a decode step (T = 1) and a prefill chunk (T = 2048).
quality: KL(fp16 cache || type) of SmolLM2-135M (FP16 weights) over held-out text, in windows of --window tokens.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from exl2_backend.bench.timing import graph_time_us
from exl2_backend.cache.kv_types import CACHE_TYPE_NAMES, CACHE_TYPES

DEV = "cuda"
HQ, HKV, D, PAGE = 32, 8, 128, 256


def _caches(ct, num_pages: int):
    """Random storage of cache type `ct` (codes and scales need no meaning for timing)."""
    shape = (num_pages, PAGE, HKV)
    if not ct.quantized:
        return (torch.randn(*shape, D, device=DEV, dtype=torch.float16),
                torch.randn(*shape, D, device=DEV, dtype=torch.float16))
    kc = torch.randint(0, 256, (*shape, ct.k.code_bytes(D)), device=DEV, dtype=torch.uint8)
    vc = torch.randint(0, 256, (*shape, ct.v.code_bytes(D)), device=DEV, dtype=torch.uint8)
    if ct.k.name == "e4m3":  # keep codes finite (0x7f / 0xff are NaN in e4m3fn)
        kc &= 0x77
        vc &= 0x77
    ks = (torch.rand(*shape, D // 32, device=DEV) * 0.1).half()
    vs = (torch.rand(*shape, D // 32, device=DEV) * 0.1).half()
    return kc, ks, vc, vs


def bench_attention(contexts, batches=(1, 8)) -> list[dict]:
    from exl2_backend.ops import cuda_kvquant, cuda_layers

    rows = []
    scale = D**-0.5
    for batch in batches:
        for ctx in contexts:
            base = None
            for name in CACHE_TYPE_NAMES:
                ct = CACHE_TYPES[name]
                read = batch * ctx * ct.bytes_per_token(1, HKV, D)  # one layer's K + V for every sequence
                nrot = max(2, min(32, math.ceil(256e6 / read)))
                pages_per_seq = -(-ctx // PAGE)
                num_pages = nrot * batch * pages_per_seq
                caches = _caches(ct, num_pages)
                perm = torch.randperm(num_pages, device=DEV).to(torch.int32)
                n = batch * pages_per_seq
                tables = [perm[r * n:(r + 1) * n].view(batch, pages_per_seq).contiguous() for r in range(nrot)]
                lens = torch.full((batch,), ctx, dtype=torch.int32, device=DEV)
                q = torch.randn(batch, 1, HQ, D, device=DEV, dtype=torch.float16)
                if ct.quantized:
                    calls = [lambda t=t, q=q, c=caches, n=lens, ct=ct: cuda_kvquant.paged_attention_quant(
                        q, *c, t, n, scale, ct.k.name, ct.v.name) for t in tables]
                else:
                    calls = [lambda t=t, q=q, c=caches, n=lens: cuda_layers.paged_attention(q, *c, t, n, scale)
                             for t in tables]
                us = graph_time_us(calls)
                base = base or us
                rows.append({"batch": batch, "context": ctx, "cache_type": name, "us": us,
                             "gbs": read / (us * 1e-6) / 1e9, "speedup_vs_fp16": base / us, "read_mb": read / 1e6})
                print(f"attention B={batch} ctx={ctx:6d} {name:5s} {us:8.1f} us {rows[-1]['gbs']:7.0f} GB/s "
                      f"x{rows[-1]['speedup_vs_fp16']:.2f} vs fp16", flush=True)
                del caches, calls
                torch.cuda.empty_cache()
    return rows


def bench_write() -> list[dict]:
    from exl2_backend.ops import cuda_kvquant, cuda_layers, reference

    rows = []
    inv = reference.rope_inv_freq(D, 500000.0).to(DEV)
    for t in (1, 2048):
        qkv = torch.randn(t, (HQ + 2 * HKV) * D, device=DEV, dtype=torch.float16)
        q, k, v = (qkv[:, :HQ * D].view(t, HQ, D), qkv[:, HQ * D:(HQ + HKV) * D].view(t, HKV, D),
                   qkv[:, (HQ + HKV) * D:].view(t, HKV, D))
        pos = torch.arange(t, device=DEV)
        slots = torch.randperm(64 * PAGE, device=DEV)[:t]
        for name in CACHE_TYPE_NAMES:
            ct = CACHE_TYPES[name]
            caches = _caches(ct, 64)
            def call(q=q, k=k, v=v, pos=pos, c=caches, slots=slots, ct=ct):
                if ct.quantized:
                    return cuda_kvquant.rope_kv_quant_write(q, k, v, pos, inv, *c, slots, ct.k.name, ct.v.name)
                return cuda_layers.rope_kv_write(q, k, v, pos, inv, *c, slots)

            us = graph_time_us([call] * 16)
            rows.append({"tokens": t, "cache_type": name, "us": us})
            print(f"rope+kv write T={t:5d} {name:5s} {us:8.2f} us", flush=True)
    return rows


def quality(window: int, max_tokens: int) -> list[dict]:
    from exl2_backend.default_model import ensure_default_fp16
    from exl2_backend.model import LlamaModel
    from exl2_backend.quant.evaluate import evaluate_models, tokenize_eval_text

    model_dir = ensure_default_fp16()  # FP16 weights: the cache type's own cost
    model = LlamaModel.from_dir(model_dir, DEV)
    ids, bos = tokenize_eval_text(model_dir, max_tokens=max_tokens)
    rows = []
    for name in CACHE_TYPE_NAMES:
        t0 = time.perf_counter()
        r = evaluate_models(model, model, ids, window=window, bos=bos, cache_type=name)
        rows.append({"cache_type": name, "kl_mean": r.kl_mean, "kl_max": r.kl_max,
                     "top1_agreement": r.top1_agreement, "perplexity": r.perplexity,
                     "reference_perplexity": r.reference_perplexity, "tokens": r.tokens, "window": window,
                     "seconds": time.perf_counter() - t0})
        print(f"quality {name:5s} KL {r.kl_mean:.6f} (max {r.kl_max:.4f}) top-1 agreement {r.top1_agreement:.4f} "
              f"ppl {r.perplexity:.4f} (fp16 cache {r.reference_perplexity:.4f}) over {r.tokens} tokens", flush=True)
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("what", choices=["attention", "quality"])
    ap.add_argument("--contexts", type=int, nargs="+", default=[8192, 32768])
    ap.add_argument("--window", type=int, default=2048)
    ap.add_argument("--max-tokens", type=int, default=16384)
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.what == "attention":
        result = {"gpu": torch.cuda.get_device_name(), "attention": bench_attention(args.contexts),
                  "write": bench_write()}
        (out / "kvcache_attention.json").write_text(json.dumps(result, indent=2))
    else:
        result = {"gpu": torch.cuda.get_device_name(), "quality": quality(args.window, args.max_tokens)}
        (out / "kvcache_quality.json").write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
