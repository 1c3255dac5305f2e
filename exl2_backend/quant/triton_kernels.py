"""Triton kernels for the converter's GPU path: the GPTQ row loop of one group, and the scale-stretch search.

Both have pure-torch references in the modules that call them (`gptq.gptq_group_reference`,
`rtn.stretch_errors_reference`) and are tested against them (bit for bit for the GPTQ loop, which is compiled
without FMA contraction so every fp32 product and sum is rounded exactly as the reference rounds it).
Importing this module needs triton; callers check `available()` first. Under TRITON_INTERPRET=1 the kernels
also run on CPU tensors (how the CPU test suite exercises them when triton is installed).
"""

from __future__ import annotations

import os

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the install
    triton = None
    tl = None

# Rounding in the kernels: (x + 12582912.0) - 12582912.0, with 12582912 = 1.5 * 2^23, rounds |x| < 2^22 to the
# nearest integer with ties to even (torch.round's rule); inputs are clamped to a few steps first. (Written as a
# literal: triton kernels may only read constexpr globals.)


def _interpret() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def available(device: torch.device | str) -> bool:
    """True when triton can run kernels on tensors of `device` (a GPU, or any device in interpreter mode)."""
    if triton is None or os.environ.get("EXL2_BACKEND_NO_TRITON") == "1":
        return False
    return _interpret() or torch.device(device).type == "cuda"


if triton is not None:

    @triton.jit
    def _gptq_group_kernel(w_ptr, u_ptr, scale_ptr, q_ptr, d_ptr, e_ptr, n, ldw, su0, su1, zf, mq,
                           rows: tl.constexpr, ROWS: tl.constexpr, BLOCK_N: tl.constexpr):
        """One program = BLOCK_N columns of one group; the group's rows stay in registers ([ROWS, BLOCK_N])."""
        cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN]
        cmask = cols < n
        ridx = tl.arange(0, ROWS)  # [R]
        rmask = ridx < rows
        tile = tl.load(w_ptr + ridx[:, None] * ldw + cols[None, :], mask=rmask[:, None] & cmask[None, :], other=0.0)
        scale = tl.load(scale_ptr + cols, mask=cmask, other=0.0)  # [BN] runtime scales (fp16 values)
        zero_col = scale == 0.0  # all-zero column in this group: stored value z
        safe = tl.where(zero_col, 1.0, scale)
        for r in range(rows):
            w_r = tl.sum(tl.where(ridx[:, None] == r, tile, 0.0), axis=0)  # [BN] current row r
            x = tl.math.div_rn(w_r, safe)
            x = tl.minimum(tl.maximum(x, -zf - 1.0), mq - zf + 1.0)  # same result after the final clamp
            x = (x + 12582912.0) - 12582912.0  # round half to even, as torch.round
            q = tl.minimum(tl.maximum(x + zf, 0.0), mq)
            q = tl.where(zero_col, zf, q)
            d = ((q - zf) * scale).to(tl.float16).to(tl.float32)  # exact product, one fp16 rounding
            u_rr = tl.load(u_ptr + r * su0 + r * su1)
            e = tl.math.div_rn(w_r - d, u_rr)
            u_row = tl.load(u_ptr + r * su0 + ridx * su1, mask=(ridx > r) & rmask, other=0.0)  # [R] U[r, r+1:]
            tile = tile - u_row[:, None] * e[None, :]  # error feedback inside the group
            tl.store(q_ptr + r * n + cols, q, mask=cmask)
            tl.store(d_ptr + r * n + cols, d, mask=cmask)
            tl.store(e_ptr + r * n + cols, e, mask=cmask)

    @triton.jit
    def _stretch_error_kernel(r_ptr, f_ptr, p_ptr, out_ptr, total, n, lo, hi, n_p: tl.constexpr, NORM: tl.constexpr,
                              BLOCK: tl.constexpr):
        """Partial sums over BLOCK elements of f * |clamp(rint(r / p), lo, hi) * p - r|^NORM for every p."""
        pid = tl.program_id(0)
        offs = pid * BLOCK + tl.arange(0, BLOCK)
        m = offs < total
        r = tl.load(r_ptr + offs, mask=m, other=0.0)
        f = tl.load(f_ptr + offs % n, mask=m, other=0.0)  # per-column weight
        for i in range(n_p):
            p = tl.load(p_ptr + i)
            x = tl.math.div_rn(r, p)
            x = tl.minimum(tl.maximum(x, lo - 1.0), hi + 1.0)
            x = (x + 12582912.0) - 12582912.0
            x = tl.minimum(tl.maximum(x, lo), hi)
            e = tl.abs(x * p - r)
            if NORM == 3.5:
                e = e * e * e * tl.sqrt(e)
            else:
                e = tl.exp2(NORM * tl.log2(e))
            tl.store(out_ptr + pid * n_p + i, tl.sum(tl.where(m, f * e, 0.0), axis=0))


def _next_pow2(x: int) -> int:
    return 1 << max(0, (x - 1).bit_length())


def gptq_group(w: torch.Tensor, u: torch.Tensor, scale: torch.Tensor, bits: int
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """GPTQ over the rows of one group. w [rows, N] fp32 (stride(1) == 1), u [rows, rows] fp32 (the group's
    block of the upper factor, any strides), scale [N] fp32 -> (q [rows, N] fp32 integral values,
    d [rows, N] fp32 (fp16-exact dequantized values), e [rows, N] fp32 scaled errors). `w` is not modified."""
    rows, n = w.shape
    if rows > 128 or w.stride(1) != 1:
        raise ValueError("gptq_group wants at most 128 rows and w with unit column stride")
    z, maxq = 1 << (bits - 1), (1 << bits) - 1
    q = torch.empty(rows, n, dtype=torch.float32, device=w.device)
    d = torch.empty_like(q)
    e = torch.empty_like(q)
    block_n = 64 if rows > 32 else 128  # [ROWS, BLOCK_N] fp32 tile in registers: <= 170 per thread, no spills
    grid = (triton.cdiv(n, block_n),)
    _gptq_group_kernel[grid](w, u, scale.contiguous(), q, d, e, n, w.stride(0), u.stride(0), u.stride(1),
                             float(z), float(maxq),
                             rows=rows, ROWS=max(32, _next_pow2(rows)), BLOCK_N=block_n, num_warps=4,
                             enable_fp_fusion=False)
    return q, d, e


def stretch_errors(r: torch.Tensor, f: torch.Tensor, p_grid: torch.Tensor, bits: int, norm: float) -> torch.Tensor:
    """r [rows, N] fp32 weights in units of their column scale, f [N] fp32 column weights, p_grid [P] fp32 on
    r's device -> float64 [P]: sum over all elements of f * |clamp(rint(r / p), -z, maxq - z) * p - r|^norm."""
    z, maxq = 1 << (bits - 1), (1 << bits) - 1
    r = r.contiguous()
    total, n = r.numel(), r.shape[-1]
    block = 1024
    blocks = triton.cdiv(total, block)
    grid_p = p_grid.contiguous()
    out = torch.empty(blocks, grid_p.numel(), dtype=torch.float32, device=r.device)
    _stretch_error_kernel[(blocks,)](r, f.contiguous(), grid_p, out, total, n, float(-z), float(maxq - z),
                                     n_p=grid_p.numel(), NORM=float(norm), BLOCK=block, num_warps=4)
    return out.double().sum(0)
