"""Tolerance rules used by every numeric test in the project.

1. Integer / bit-level work (packing, dequant, cache writes, token ids, greedy sampling) is exact:
   `assert_exact` (torch.equal plus dtype and shape checks; fp16 compared bit for bit).
2. Elementwise ops (norms, rope, silu, ...) against a reference computed the same way: `assert_close`, with
   the per-dtype atol/rtol of `TOLERANCES` (about a few ulps of the output dtype).
3. Reductions whose order differs between implementations (GEMM, attention): `assert_close_rel` -- the
   tested output may be at most `factor` (2x) as far from an fp32 reference as a plain torch run in the
   same precision is, plus a small atol. This scales with K and with the data, unlike a fixed tolerance.
"""

from __future__ import annotations

import math

import torch

# dtype -> (atol, rtol)
TOLERANCES: dict[torch.dtype, tuple[float, float]] = {
    torch.float64: (1e-10, 1e-9),
    torch.float32: (1e-5, 5e-6),
    torch.float16: (1e-3, 2e-3),
    torch.bfloat16: (1e-2, 1.6e-2),
}

# extra absolute slack for assert_close_rel, per dtype of the tested output
REL_ATOL: dict[torch.dtype, float] = {
    torch.float32: 1e-5,
    torch.float16: 2e-3,
    torch.bfloat16: 1.6e-2,
}


def tol(dtype: torch.dtype) -> tuple[float, float]:
    """(atol, rtol) for elementwise comparisons in `dtype`."""
    return TOLERANCES[dtype]


def assert_exact(actual: torch.Tensor, expected: torch.Tensor, msg: str = "") -> None:
    """Same dtype, shape and bits (for floats: bitwise, so -0.0 != 0.0 and NaN payloads count)."""
    assert actual.dtype == expected.dtype, f"{msg} dtype {actual.dtype} != {expected.dtype}"
    assert actual.shape == expected.shape, f"{msg} shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    a, e = actual.detach().cpu(), expected.detach().cpu()
    if a.is_floating_point():
        bits = {2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
        a, e = a.contiguous().view(bits), e.contiguous().view(bits)
    if not torch.equal(a, e):
        diff = (a != e).nonzero()
        raise AssertionError(f"{msg} {diff.shape[0]} of {a.numel()} elements differ, first at {diff[0].tolist()}")


def assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype | None = None, msg: str = "") -> None:
    """Elementwise closeness with the tolerance of `dtype` (default: actual.dtype)."""
    atol, rtol = tol(dtype or actual.dtype)
    torch.testing.assert_close(
        actual.detach().cpu().double(), expected.detach().cpu().double(), atol=atol, rtol=rtol, msg=msg or None
    )


def assert_close_rel(
    out: torch.Tensor,
    ref_fp32: torch.Tensor,
    same_precision_out: torch.Tensor,
    factor: float = 2.0,
    atol: float | None = None,
    msg: str = "",
) -> None:
    """max|out - ref_fp32| <= factor * max|same_precision_out - ref_fp32| + atol.

    `ref_fp32` is the fp32 (or better) reference; `same_precision_out` is a plain torch computation in the
    precision under test (e.g. fp16 matmul, fp16 SDPA). atol defaults to REL_ATOL[out.dtype]."""
    assert out.shape == ref_fp32.shape == same_precision_out.shape, (
        f"{msg} shapes {tuple(out.shape)}, {tuple(ref_fp32.shape)}, {tuple(same_precision_out.shape)}"
    )
    ref = ref_fp32.detach().cpu().double()
    err = (out.detach().cpu().double() - ref).abs().max().item() if out.numel() else 0.0
    base = (same_precision_out.detach().cpu().double() - ref).abs().max().item() if out.numel() else 0.0
    slack = REL_ATOL.get(out.dtype, 1e-5) if atol is None else atol
    assert not math.isnan(err) and err <= factor * base + slack, (
        f"{msg} max error {err:.3g} > {factor} x same-precision error {base:.3g} + {slack:.3g}"
    )
