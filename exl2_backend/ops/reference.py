"""Pure-torch definition of every op (docs/internals.md, "ops"). Runs on any device; it is the oracle the CUDA
kernels are tested against, so it favours exactness and clarity over speed. Sampling lives in
`reference_sampling.py` and is re-exported here."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from exl2_backend.errors import ConfigError, TensorShapeError
from exl2_backend.format.packing import unpack_columns, unpack_scales
from exl2_backend.format.qtensor import QTensor
from exl2_backend.ops.reference_sampling import (  # noqa: F401  (re-exported)
    apply_penalties,
    faulty_rows,
    greedy_tokens,
    make_generator,
    make_uniforms,
    sample_tokens,
    sampling_probs,
)

_UNPACK_CHUNK_WORDS = 1 << 20  # packed words per unpack_columns call, bounding its int64 temporaries


# --- EXL2 linears ------------------------------------------------------------------------------------


def exl2_dequant(qt: QTensor) -> torch.Tensor:
    """fp16 [K, Np], rows in original feature order, bit-exact with ExLlamaV2 (format doc b.4-b.6).

    Every fp16 step is computed as an exact fp32 product rounded once to fp16, which equals IEEE fp16
    multiplication (both operands have 11-bit significands, so the fp32 product is exact)."""
    device = qt.q_weight.device
    np_ = qt.padded_out_features
    codes = unpack_scales(qt.q_scale.cpu()).to(device)  # [G, Np]
    max16 = (qt.q_scale_max.float() * (1.0 / 256)).half()  # [G], may be subnormal: keep that rounding
    rows = []
    for g, gr in enumerate(qt.groups):
        qrows = gr.rows * gr.bits // 32
        q = _unpack_group(qt.q_weight[gr.qrow_start : gr.qrow_start + qrows], gr.bits)  # [rows, Np] int32
        sq = ((codes[g] + 1) ** 2).half()  # [Np], exact in fp16 (<= 256)
        scale = (sq.float() * max16[g].float()).half()  # [Np]
        qz = (q - (1 << (gr.bits - 1))).half()  # [rows, Np], exact
        rows.append((qz.float() * scale.float()).half())
    w_stored = torch.cat(rows, dim=0) if rows else torch.empty(0, np_, dtype=torch.float16, device=device)
    # original feature i is stored at row q_invperm[i]
    return w_stored.index_select(0, qt.q_invperm.to(device=device, dtype=torch.long))


def _unpack_group(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """unpack_columns in chunks of whole 32-row units (bounded memory); it builds CPU index tensors, so
    non-CPU inputs take a round trip through the CPU."""
    qrows, np_ = packed.shape
    unit = bits  # packed rows per 32 values
    step = max(unit, (_UNPACK_CHUNK_WORDS // max(np_, 1)) // unit * unit)
    out = [unpack_columns(packed[i : i + step].cpu(), bits) for i in range(0, qrows, step)]
    return torch.cat(out, dim=0).to(packed.device)


def exl2_gemm(x: torch.Tensor, qt: QTensor) -> torch.Tensor:
    """x [M, K] -> [M, N] in x.dtype: fp32 `x @ dequant[:, :N]` (+ bias[:N])."""
    n = qt.out_features
    w = exl2_dequant(qt).float()[:, :n]  # [K, N]
    y = x.float() @ w
    if qt.bias is not None:
        y = y + qt.bias[:n].float()
    return y.to(x.dtype)


def dense_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K], weight [N, K], bias [N] | None -> [M, N] in x.dtype (fp32 math)."""
    y = x.float() @ weight.float().t()
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


class LinearOp:
    """One or several linears sharing an input, as one dense matmul with outputs concatenated.

    The weight is dequantized once here. On CPU it is kept (and computed) in fp32 for speed and accuracy;
    elsewhere in `dtype`. `__call__(x [..., K]) -> [..., sum N]` in `dtype`."""

    def __init__(self, weight_t: torch.Tensor, bias: torch.Tensor | None, splits: list[int], dtype: torch.dtype):
        self.weight_t = weight_t  # [K, sum N]
        self.bias = bias  # [sum N] | None
        self.splits = list(splits)
        self.dtype = dtype
        self.in_features = int(weight_t.shape[0])
        self.out_features = int(weight_t.shape[1])

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features).to(self.weight_t.dtype)  # [M, K]
        y = x2 @ self.weight_t
        if self.bias is not None:
            y = y + self.bias
        return y.to(self.dtype).reshape(*lead, self.out_features)

    def __repr__(self) -> str:
        return f"LinearOp(in={self.in_features}, splits={self.splits}, weight={self.weight_t.dtype})"


def prepare_linear(linears: list, device, dtype: torch.dtype = torch.float16) -> LinearOp:
    """linears: QTensor (has `.q_weight`) or dense (has `.weight` [N, K], `.bias`), all with the same K."""
    device = torch.device(device)
    store = torch.float32 if device.type == "cpu" else dtype
    parts, biases, splits = [], [], []
    for lin in linears:
        if hasattr(lin, "q_weight"):
            n = lin.out_features
            w_t = exl2_dequant(lin)[:, :n]  # [K, N]
            b = None if lin.bias is None else lin.bias[:n]
        elif hasattr(lin, "weight"):
            w_t = lin.weight.t()  # [K, N]
            n = int(w_t.shape[1])
            b = getattr(lin, "bias", None)
        else:
            raise TypeError(f"prepare_linear: {type(lin).__name__} is neither a QTensor nor a dense linear")
        parts.append(w_t.to(device=device, dtype=store))
        biases.append(b)
        splits.append(n)
    ks = [int(p.shape[0]) for p in parts]
    if len(set(ks)) != 1:
        key = ", ".join(str(getattr(lin, "key", "?")) for lin in linears)
        raise TensorShapeError(f"fused linears have different in_features: {ks}", tensor=key)
    weight_t = torch.cat(parts, dim=1).contiguous()
    bias = None
    if any(b is not None for b in biases):
        bias = torch.cat([
            torch.zeros(n, dtype=store, device=device) if b is None else b.to(device=device, dtype=store)
            for b, n in zip(biases, splits)
        ])
    return LinearOp(weight_t, bias, splits, dtype)


# --- norms, activations, embedding -------------------------------------------------------------------


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [T, H], weight [H] -> [T, H] in x.dtype; fp32 math, one rounding at the end."""
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (y * weight.float()).to(x.dtype)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float):
    """-> (rms_norm(x + residual) [T, H], x + residual [T, H]). The sum is rounded to x.dtype first, so the
    normed output is exactly what an unfused add-then-norm gives."""
    s = (x.float() + residual.float()).to(x.dtype)
    return rms_norm(s, weight, eps), s


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """gate, up [T, I] -> silu(gate) * up [T, I] in gate.dtype (fp32 math)."""
    return (F.silu(gate.float()) * up.float()).to(gate.dtype)


def embedding(ids: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """ids [T] int64, table [V, H] -> [T, H]."""
    return table.index_select(0, ids.to(device=table.device, dtype=torch.long))


# --- rotary embedding --------------------------------------------------------------------------------


def rope_inv_freq(head_dim: int, rope_theta: float, scaling=None) -> torch.Tensor:
    """fp32 [D/2] inverse frequencies; `scaling` is a RopeScaling (duck-typed) or None.

    default: theta^(-2i/D). linear: divided by factor (same as dividing positions). llama3: wavelengths
    beyond original_max/low_freq_factor are divided by factor, those below original_max/high_freq_factor
    kept, and the band in between interpolated smoothly (as HF's llama3 rope)."""
    inv = 1.0 / (rope_theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    kind = getattr(scaling, "rope_type", None) if scaling is not None else None
    if kind in (None, "default"):
        return inv
    factor = float(getattr(scaling, "factor", 1.0) or 1.0)
    if kind == "linear":
        return inv / factor
    if kind == "llama3":
        low = float(scaling.low_freq_factor)
        high = float(scaling.high_freq_factor)
        old_len = float(scaling.original_max_position_embeddings)
        wavelen = 2 * math.pi / inv
        smooth = (old_len / wavelen - low) / (high - low)  # 0 at the low-freq edge, 1 at the high-freq edge
        mid = (1 - smooth) * inv / factor + smooth * inv
        out = torch.where(wavelen > old_len / low, inv / factor, inv)
        in_band = (wavelen >= old_len / high) & (wavelen <= old_len / low)
        return torch.where(in_band, mid, out)
    raise ConfigError(f"rope_scaling type {kind!r} is not supported (default, linear, llama3)", field="rope_scaling")


def apply_rope(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """x [T, Hx, D], positions [T] int64, inv_freq [D/2] -> [T, Hx, D] in x.dtype (NeoX half rotation)."""
    half = x.shape[-1] // 2
    ang = positions.to(x.device).float()[:, None] * inv_freq.to(x.device).float()[None, :]  # [T, D/2] fp32
    cos, sin = ang.cos()[:, None, :], ang.sin()[:, None, :]  # [T, 1, D/2]
    xf = x.float()
    x1, x2 = xf[..., :half], xf[..., half:]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)


# --- paged KV cache and attention --------------------------------------------------------------------


def kv_cache_write(k, v, k_cache, v_cache, slots) -> None:
    """k, v [T, Hkv, D] -> k_cache, v_cache [P, S, Hkv, D] at slots [T] (page * S + offset), in place.
    Negative slots (padding tokens) are skipped."""
    p, s, hkv, d = k_cache.shape
    slots = slots.to(device=k_cache.device, dtype=torch.long)
    keep = slots >= 0
    if not bool(keep.all()):
        slots, k, v = slots[keep], k[keep.to(k.device)], v[keep.to(v.device)]
    k_cache.view(p * s, hkv, d).index_copy_(0, slots, k.to(k_cache.dtype))
    v_cache.view(p * s, hkv, d).index_copy_(0, slots, v.to(v_cache.dtype))


def rope_kv_write(q, k, v, positions, inv_freq, k_cache, v_cache, slots) -> None:
    """The decode-step attention prologue as one op: q [T, Hq, D] <- apply_rope(q) in place (q may be a view,
    e.g. of a fused QKV output); apply_rope(k) and v [T, Hkv, D] written into k_cache, v_cache [P, S, Hkv, D]
    at slots [T] like kv_cache_write (negative slots skipped). Same values as the three ops apart."""
    q.copy_(apply_rope(q, positions, inv_freq))
    kv_cache_write(apply_rope(k, positions, inv_freq), v, k_cache, v_cache, slots)


def paged_attention(q, k_cache, v_cache, block_tables, context_lens, scale: float) -> torch.Tensor:
    """q [B, Tq, Hq, D], caches [P, S, Hkv, D], block_tables [B, max_pages] int32, context_lens [B] int32
    -> [B, Tq, Hq, D] in q.dtype. Query j of sequence b sits at position context_lens[b] - Tq + j and sees
    cached positions <= its own. GQA: query head h reads kv head h // (Hq / Hkv). fp32 scores and softmax.
    A query that sees no key (position < 0) yields zeros. Only the first ceil(len / S) pages are read."""
    b_, tq, hq, d = q.shape
    s, hkv = k_cache.shape[1], k_cache.shape[2]
    grp = hq // hkv
    out = torch.zeros_like(q)
    lens = context_lens.tolist()
    tables = block_tables.cpu()
    for b in range(b_):
        n = int(lens[b])
        if n <= 0:
            continue
        pages = tables[b, : -(-n // s)].to(device=k_cache.device, dtype=torch.long)
        k = k_cache.index_select(0, pages).reshape(-1, hkv, d)[:n].float()  # [n, Hkv, D]
        v = v_cache.index_select(0, pages).reshape(-1, hkv, d)[:n].float()
        qb = q[b].float().reshape(tq, hkv, grp, d)  # [Tq, Hkv, G, D]
        scores = torch.einsum("thgd,nhd->hgtn", qb, k) * scale  # [Hkv, G, Tq, n]
        qpos = torch.arange(tq, device=q.device) + (n - tq)  # [Tq]
        visible = torch.arange(n, device=q.device)[None, :] <= qpos[:, None]  # [Tq, n]
        scores = scores.masked_fill(~visible, float("-inf"))
        probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # fully masked rows -> 0
        o = torch.einsum("hgtn,nhd->thgd", probs, v)  # [Tq, Hkv, G, D]
        out[b] = o.reshape(tq, hq, d).to(q.dtype)
    return out
