"""Decode / verify attention outputs over every cache type, for a bit-for-bit comparison of two libraries.

A device-call check for kernel changes that must not change a bit (session 44: the 4-bit codes' dequantization
and the staged kernel's copy addresses). Run it once per library (and per EXL2_ATTN_STAGED setting, which picks
the staged or the register kernels), then compare:

    python3 scripts/device/attn_bits.py --out /tmp/a.pt        # library A
    python3 scripts/device/attn_bits.py --out /tmp/b.pt        # library B
    python3 scripts/device/attn_bits.py --compare /tmp/a.pt /tmp/b.pt

Cases: cache types fp16, fp8, q8, q6, q4; head_dim 64 (8 query / 2 kv heads) and 128 (32 / 8); batch 2 with
contexts (n, n // 2 + 3) for n in 1, 37, 1024, 5000; 1 query row (decode) and 5 (a k = 4 verify step); pages of
256 filled with random codes and scales.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent.parent))

from exl2_backend.cache import PagedKVCache
from exl2_backend.ops import dispatch

PAGE = 256
TYPES = ("fp16", "fp8", "q8", "q6", "q4")
SHAPES = ((64, 8, 2), (128, 32, 8))  # head_dim, query heads, kv heads
CONTEXTS = (1, 37, 1024, 5000)
ROWS = (1, 5)


def fill(cache: PagedKVCache, g: torch.Generator) -> None:
    for t in [cache.k[0], cache.v[0]] + ([cache.k_scales[0], cache.v_scales[0]] if cache.quantized else []):
        if t.dtype == torch.uint8:
            t.copy_(torch.randint(0, 256, t.shape, generator=g, device=t.device, dtype=torch.int32).to(torch.uint8))
        else:
            t.copy_(torch.rand(t.shape, generator=g, device=t.device).to(t.dtype) * 0.02)


def outputs(device: torch.device) -> dict[str, torch.Tensor]:
    out = {}
    for ct in TYPES:
        for d, hq, hkv in SHAPES:
            for n in CONTEXTS:
                lens_list = [n, n // 2 + 3]
                per_seq = -(-max(lens_list) // PAGE)
                cache = PagedKVCache(1, 2 * per_seq, PAGE, hkv, d, torch.float16, device, ct)
                g = torch.Generator(device=device).manual_seed(n * 131 + d)
                fill(cache, g)
                tables = torch.arange(2 * per_seq, dtype=torch.int32, device=device).view(2, per_seq)
                lens = torch.tensor(lens_list, dtype=torch.int32, device=device)
                for rows in ROWS:
                    q = torch.randn(2, rows, hq, d, generator=g, device=device).half()
                    if cache.quantized:
                        o = dispatch.paged_attention_quant(q, cache.k[0], cache.k_scales[0], cache.v[0],
                                                           cache.v_scales[0], tables, lens, d**-0.5,
                                                           cache.k_format, cache.v_format)
                    else:
                        o = dispatch.paged_attention(q, cache.k[0], cache.v[0], tables, lens, d**-0.5)
                    out[f"{ct}/d{d}/n{n}/rows{rows}"] = o.float().cpu()
    return out


def compare(a_path: str, b_path: str) -> int:
    a, b = torch.load(a_path), torch.load(b_path)
    bad = 0
    for name in sorted(set(a) | set(b)):
        if name not in a or name not in b:
            print(f"{name}: only in {'A' if name in a else 'B'}")
            bad += 1
            continue
        x, y = a[name], b[name]
        same = x.shape == y.shape and torch.equal(x.view(torch.int32), y.view(torch.int32))
        if not same:
            diff = (x - y).abs().nan_to_num(float("inf")).max().item() if x.shape == y.shape else float("nan")
            print(f"{name}: DIFFERENT (max abs diff {diff:.3g})")
            bad += 1
    print(f"{len(a)} cases, {bad} different")
    return 1 if bad else 0


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out")
    ap.add_argument("--compare", nargs=2)
    ap.add_argument("--device", default="cuda", help="cpu: the reference ops (a check of this script)")
    args = ap.parse_args()
    if args.compare:
        return compare(*args.compare)
    res = outputs(torch.device(args.device))
    torch.save(res, args.out)
    print(f"{len(res)} outputs -> {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
