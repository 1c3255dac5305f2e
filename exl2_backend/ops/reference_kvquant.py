"""Pure-torch reference of the quantized KV cache: the codecs, the quantize-on-write op and attention over
quantized pages. The CUDA kernels (csrc/layers/kv_quant.cu, paged_attention_quant.cu) reproduce the write
op's codes and scales bit for bit, so every step here is spelled out in fp32 in a fixed order.

Per (token, kv head) row of D elements, in groups of G = 32 (formats in `exl2_backend/cache/kv_types.py`):
  1. x = the row in fp32 (k after RoPE, rounded to the activation dtype as the model would store it).
  2. integer formats: y = fwht32(x) * (1/sqrt(32)) per group (butterfly stages h = 1, 2, 4, 8, 16:
     (a, b) -> (a + b, a - b)), an orthonormal, self-inverse rotation. e4m3: y = x.
  3. scale = fp16(min(absmax(y) / divisor, 65504)) per group (IEEE fp32 division); s = float(scale). The
     divisor is qmax (448 e4m3, 127 int8); int4 tries 7, 7.5, 8, 8.5, 9, 10 and keeps the first with the
     smallest sum of (y - c * s)^2, summed in the fixed halving order (i, i + 16), (i, i + 8), ... .
  4. int8 / int4: c = clamp(round_half_even(y / s), -qmax - 1, qmax), stored as c + 128 / c + 8 (unsigned);
     e4m3: the e4m3fn code (round to nearest even) of clamp(y / s, -448, 448). A zero scale stores code 0
     (value 0). int4 packs element 2j in the low nibble of byte j and 2j + 1 in the high nibble.
  5. dequantize: (c - bias) * s (or e4m3 value * s) in fp32, then the same rotation again.

Cache layout per layer (`PagedKVCache` with a quantized type): codes uint8 [P, S, Hkv, D * bits / 8] and
scales fp16 [P, S, Hkv, D / 32], for K and V.
"""

from __future__ import annotations

import math

import torch

from exl2_backend.cache.kv_types import FORMATS, GROUP, KVFormat
from exl2_backend.ops import reference

INV_SQRT_GROUP = 1.0 / math.sqrt(GROUP)  # rounded to fp32 where used, like the kernels' literal
FP16_MAX = 65504.0


def _fmt(fmt: str | KVFormat) -> KVFormat:
    return fmt if isinstance(fmt, KVFormat) else FORMATS[fmt]


def fwht32(x: torch.Tensor) -> torch.Tensor:
    """Orthonormal Walsh-Hadamard transform of each consecutive block of 32 along the last dim (fp32 in, fp32
    out): the butterfly (a, b) -> (a + b, a - b) at strides 1, 2, 4, 8, 16, then a multiply by 1/sqrt(32).
    Self-inverse."""
    shape = x.shape
    y = x.reshape(-1, GROUP)  # [N, 32]
    h = 1
    while h < GROUP:
        y = y.view(-1, GROUP // (2 * h), 2, h)  # pairs (i, i + h) within blocks of 2h
        a, b = y[:, :, 0], y[:, :, 1]
        y = torch.stack((a + b, a - b), dim=2)
        h *= 2
    return y.reshape(shape) * torch.tensor(INV_SQRT_GROUP, dtype=torch.float32)


def _scaled(g: torch.Tensor, amax: torch.Tensor, divisor: float):
    """-> (scale fp16 [..., G], g / scale [..., G, 32] (g where the scale is 0), zero-scale mask [..., G, 1])."""
    # tensor / tensor: a true IEEE division on every device (a python scalar divisor may become a reciprocal
    # multiply in ATen's CUDA kernels)
    scale = torch.div(amax, torch.full_like(amax, divisor)).clamp(max=FP16_MAX).half()  # [..., G]
    s = scale.float()[..., None]  # [..., G, 1]
    zero = s == 0
    return scale, torch.div(g, torch.where(zero, torch.ones_like(s), s)), zero


def _halving_sum(e: torch.Tensor) -> torch.Tensor:
    """Sum over the last dim (32) in the order of a warp's xor reduction: (i, i + 16), then (i, i + 8), ..."""
    while e.shape[-1] > 1:
        h = e.shape[-1] // 2
        e = e[..., :h] + e[..., h:]
    return e[..., 0]


def quantize(x: torch.Tensor, fmt: str | KVFormat) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., D] (any float dtype, D % 32 == 0) -> (codes uint8 [..., D * bits / 8], scales fp16 [..., D / 32])."""
    f = _fmt(fmt)
    d = x.shape[-1]
    if d % GROUP:
        raise ValueError(f"quantize: last dim {d} is not a multiple of {GROUP}")
    y = x.float()
    if f.rotated:
        y = fwht32(y)
    g = y.reshape(*x.shape[:-1], d // GROUP, GROUP)  # [..., G, 32]
    amax = g.abs().amax(-1)  # [..., G]
    if f.name == "e4m3":
        scale, v, zero = _scaled(g, amax, float(f.qmax))
        v = torch.where(zero, torch.zeros_like(v), v.clamp(-448.0, 448.0))
        codes = v.to(torch.float8_e4m3fn).view(torch.uint8)
    else:
        bias = f.qmax + 1
        best = None
        for div in f.scale_divisors:
            sc, v, zero = _scaled(g, amax, div)
            c = torch.where(zero, torch.zeros_like(v), torch.round(v).clamp(-bias, f.qmax))  # [..., G, 32]
            diff = g - c * sc.float()[..., None]
            err = _halving_sum(diff * diff)  # [..., G]
            if best is None:
                best = (sc, c, err)
            else:
                better = err < best[2]  # strict: the earlier divisor wins ties
                best = (torch.where(better, sc, best[0]), torch.where(better[..., None], c, best[1]),
                        torch.where(better, err, best[2]))
        scale, c = best[0], best[1]
        codes = (c + bias).to(torch.uint8)
    codes = codes.reshape(*x.shape[:-1], d)
    if f.bits == 4:
        codes = codes[..., 0::2] | (codes[..., 1::2] << 4)  # [..., D/2]
    return codes.contiguous(), scale


def unpack_codes(codes: torch.Tensor, fmt: str | KVFormat) -> torch.Tensor:
    """codes uint8 [..., D * bits / 8] -> one uint8 code per element [..., D]."""
    if _fmt(fmt).bits != 4:
        return codes
    return torch.stack((codes & 15, codes >> 4), dim=-1).flatten(-2)


def dequantize(codes: torch.Tensor, scales: torch.Tensor, fmt: str | KVFormat) -> torch.Tensor:
    """(codes uint8 [..., D * bits / 8], scales fp16 [..., D / 32]) -> fp32 [..., D]."""
    f = _fmt(fmt)
    d = scales.shape[-1] * GROUP
    c = unpack_codes(codes, f)
    if f.name == "e4m3":
        v = c.contiguous().view(torch.float8_e4m3fn).float()
    else:
        v = c.float() - float(f.qmax + 1)
    v = (v.reshape(*scales.shape, GROUP) * scales.float()[..., None]).reshape(*scales.shape[:-1], d)
    return fwht32(v) if f.rotated else v


# --- cache ops -------------------------------------------------------------------------------------------


def kv_quant_write(k, v, k_codes, k_scales, v_codes, v_scales, slots, k_fmt: str, v_fmt: str) -> None:
    """k, v [T, Hkv, D] -> quantized into the caches (codes [P, S, Hkv, Dk'], scales [P, S, Hkv, D/32]) at
    slots [T] (page * S + offset), in place. Negative slots (padding tokens) are skipped."""
    p, s, hkv = k_scales.shape[:3]
    slots = slots.to(device=k_codes.device, dtype=torch.long)
    keep = slots >= 0
    if not bool(keep.all()):
        slots, k, v = slots[keep], k[keep.to(k.device)], v[keep.to(v.device)]
    for x, codes_c, scales_c, fmt in ((k, k_codes, k_scales, k_fmt), (v, v_codes, v_scales, v_fmt)):
        codes, scales = quantize(x.to(codes_c.device), fmt)
        codes_c.view(p * s, hkv, -1).index_copy_(0, slots, codes)
        scales_c.view(p * s, hkv, -1).index_copy_(0, slots, scales)


def rope_kv_quant_write(q, k, v, positions, inv_freq, k_codes, k_scales, v_codes, v_scales, slots, k_fmt: str,
                        v_fmt: str) -> None:
    """q [T, Hq, D] <- apply_rope(q) in place; apply_rope(k) (rounded to k.dtype) and v quantized into the
    caches at slots [T] like kv_quant_write. Same values as the ops apart."""
    q.copy_(reference.apply_rope(q, positions, inv_freq))
    kv_quant_write(reference.apply_rope(k, positions, inv_freq), v, k_codes, k_scales, v_codes, v_scales, slots,
                   k_fmt, v_fmt)


def dequantize_pages(codes: torch.Tensor, scales: torch.Tensor, pages: torch.Tensor, fmt: str,
                     dtype: torch.dtype = torch.float32, pages_per_step: int = 64) -> torch.Tensor:
    """The pages `pages` [U] (int64) of one cache -> [U, S, Hkv, D] in `dtype`, dequantized a few pages at a
    time (bounds the fp32 temporaries)."""
    _p, s, hkv, g = scales.shape
    out = torch.empty(pages.shape[0], s, hkv, g * GROUP, dtype=dtype, device=codes.device)
    for i in range(0, pages.shape[0], pages_per_step):
        idx = pages[i : i + pages_per_step]
        out[i : i + pages_per_step] = dequantize(codes.index_select(0, idx), scales.index_select(0, idx), fmt)
    return out


def gather_dequantized(k_codes, k_scales, v_codes, v_scales, block_tables, context_lens, k_fmt: str, v_fmt: str,
                       dtype: torch.dtype = torch.float32):
    """Dequantize only the pages the sequences read (the first ceil(len / S) of each block table) into a
    compact cache. -> (k [U, S, Hkv, D], v [U, S, Hkv, D], block_tables [B, max_pages] int32 remapped to it).
    Table entries past a sequence's pages map to page 0 (never read)."""
    s = k_scales.shape[1]
    dev = k_codes.device
    tables = block_tables.to(device=dev, dtype=torch.long)  # [B, max_pages]
    lens = context_lens.to(device=dev, dtype=torch.long).clamp(min=0)  # [B]
    used = torch.arange(tables.shape[1], device=dev)[None, :] < ((lens + s - 1) // s)[:, None]  # [B, max_pages]
    used &= (tables >= 0) & (tables < k_codes.shape[0])
    pages = torch.unique(tables[used])  # [U] sorted
    if pages.numel() == 0:
        pages = torch.zeros(1, dtype=torch.long, device=dev)
    remap = torch.searchsorted(pages, tables.clamp(0, k_codes.shape[0] - 1))  # [B, max_pages]
    remap = torch.where(used, remap, torch.zeros_like(remap)).to(torch.int32)
    k = dequantize_pages(k_codes, k_scales, pages, k_fmt, dtype)
    v = dequantize_pages(v_codes, v_scales, pages, v_fmt, dtype)
    return k, v, remap


def paged_attention_quant(q, k_codes, k_scales, v_codes, v_scales, block_tables, context_lens, scale: float,
                          k_fmt: str, v_fmt: str) -> torch.Tensor:
    """reference.paged_attention over a quantized cache: the pages each sequence reads are dequantized to fp32,
    then the same fp32 attention. q [B, Tq, Hq, D] -> [B, Tq, Hq, D] in q.dtype."""
    k, v, tables = gather_dequantized(k_codes, k_scales, v_codes, v_scales, block_tables, context_lens, k_fmt, v_fmt)
    return reference.paged_attention(q, k, v, tables, context_lens, scale)
