"""Checks of the converter's triton kernels against their pure-torch references, on one device.

Used by the cuda tests (real GPU) and, through a subprocess with TRITON_INTERPRET=1, by a CPU test when triton
is installed. `python -m tests.helpers.quant_kernels cpu [--quick]` runs them and prints "ok".
"""

from __future__ import annotations

import sys

import torch

# (rows, N, bits): group heights of every layout (32/64/128, a cut last group of 96), odd and padded widths
CASES = [(32, 33, 4), (64, 200, 2), (96, 70, 8), (128, 64, 3), (128, 320, 5), (32, 1, 6), (64, 130, 8)]
QUICK_CASES = [(32, 33, 4), (96, 20, 8), (64, 1, 2)]  # for triton's (slow) interpreter


def _factor(k: int, g: torch.Generator, device: str) -> torch.Tensor:
    from exl2_backend.quant.gptq import HessianAccumulator, PreparedHessian

    mix = torch.randn(k, k, generator=g) / k**0.5
    x = (torch.randn(4 * k, k, generator=g) @ mix) * (0.3 + 2 * torch.rand(k, generator=g))  # [4K, K]
    acc = HessianAccumulator(k)
    acc.add(x)
    return PreparedHessian.from_hessian(acc.result(), k).u.to(device)


def check_kernels(device: str, quick: bool = False) -> None:
    """gptq_group equals gptq_group_reference bit for bit; stretch_errors equals stretch_errors_reference to
    fp32 summation error (relative 1e-5) and picks an equally good stretch."""
    from exl2_backend.quant import triton_kernels
    from exl2_backend.quant.gptq import gptq_group_reference
    from exl2_backend.quant.rtn import NORM, P_GRID, runtime_scales, search_group_scales, stretch_errors_reference

    assert triton_kernels.available(device), "triton cannot run on this device"
    g = torch.Generator().manual_seed(7)
    u_full = _factor(160, g, device)
    for i, (rows, n, bits) in enumerate(QUICK_CASES if quick else CASES):
        w = (torch.randn(rows, n, generator=g) * torch.rand(n, generator=g) * 0.05).to(device)
        if n > 3:
            w[:, 3] = 0  # an all-zero column: scale 0
        codes, qsm = search_group_scales(w, bits)
        scale = runtime_scales(qsm.unsqueeze(0), codes.unsqueeze(0))[0].float()  # [N]
        u = u_full[10 : 10 + rows, 10 : 10 + rows]  # a diagonal block, row stride 160 as in the converter
        if i % 2:
            u = u.t().contiguous().t()  # column-major: the kernel takes any strides
        w_before = w.clone()
        got = triton_kernels.gptq_group(w, u, scale, bits)
        want = gptq_group_reference(w, u, scale, bits)
        assert torch.equal(w, w_before), "gptq_group modified its input"
        for name, a, b in zip("qde", got, want):
            assert torch.equal(a, b), (rows, n, bits, name, float((a - b).abs().max()))
        maxq = (1 << bits) - 1
        base = (w.abs().amax(0) + 1e-12) / (maxq / 2)
        qs = torch.clamp(torch.round(16 * torch.sqrt(base / base.max())), 1, 16)
        s = (qs / 16) ** 2 * base.max()
        r, f = w / s, (s / base.max()) ** NORM
        grid = P_GRID.to(device)
        e_tri = triton_kernels.stretch_errors(r, f, grid, bits, NORM)
        e_ref = stretch_errors_reference(r, f, grid, bits)
        rel = ((e_tri - e_ref).abs() / e_ref.abs().clamp_min(1e-300)).max()
        assert rel < 1e-5, (rows, n, bits, float(rel))
        assert e_ref[int(e_tri.argmin())] <= e_ref.min() * (1 + 1e-5)


if __name__ == "__main__":
    check_kernels(sys.argv[1] if len(sys.argv) > 1 else "cpu", quick="--quick" in sys.argv)
    print("ok")
