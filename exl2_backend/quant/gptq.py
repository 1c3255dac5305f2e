"""GPTQ with mixed bit widths per group (format doc d.5), producing an EXL2 QTensor.

Rows are processed in activation order (descending Hessian diagonal). Each group of the option's layout gets
its scales from the *current*, error-compensated weights (rtn.search_group_scales), is quantized row by row
with GPTQ error feedback inside the group, and then pushes its accumulated error onto all later rows (the
group is the lazy-update block). Dequantized values are computed with the exact fp16 steps of the runtime,
so `exl2_dequant(result.qtensor)` equals `result.dequant` bit for bit.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from exl2_backend.errors import ModelFormatError
from exl2_backend.format.build import build_qtensor
from exl2_backend.format.layout import QuantOption
from exl2_backend.format.qtensor import QTensor, pad32
from exl2_backend.quant.rtn import check_scale_maxima, runtime_scales, search_group_scales

DAMP = 0.12  # relative damping of the Hessian diagonal (ExLlamaV2's value)
DAMP_RETRIES = 10


@dataclass
class GPTQResult:
    qtensor: QTensor | None  # on the CPU; None when not packed (measurement)
    dequant: torch.Tensor  # fp16 [K, Np] on the weight's device, original feature order: exl2_dequant(qtensor)
    out_features: int

    def weight(self) -> torch.Tensor:
        """fp32 [N, K] HF layout of the quantized weight (for running the model on it)."""
        return self.dequant[:, : self.out_features].float().t().contiguous()


class HessianAccumulator:
    """Running H = sum(x^T x) / n over calibration activations, fp32 (format doc d.5), on `device`."""

    def __init__(self, k: int, device: torch.device | str = "cpu"):
        self.h = torch.zeros(k, k, dtype=torch.float32, device=device)
        self.n = 0

    def add(self, x: torch.Tensor) -> None:
        x = x.reshape(-1, x.shape[-1]).to(self.h.device, torch.float32)  # [tokens, K]
        self.h.addmm_(x.t(), x)
        self.n += x.shape[0]

    def result(self) -> torch.Tensor:
        return self.h / max(self.n, 1) if self.n else torch.eye(self.h.shape[0], device=self.h.device)


def act_order(h: torch.Tensor) -> torch.Tensor:
    """perm [K]: stored row k holds original feature perm[k] (descending diag(H); stable for ties)."""
    return torch.argsort(torch.diag(h), descending=True, stable=True)


def _upper_inverse_factor(h: torch.Tensor) -> torch.Tensor:
    """Upper Cholesky factor U of (H + damping)^-1, retrying with more damping when H is not PD."""
    k = h.shape[0]
    base = max(DAMP * float(torch.diag(h).mean()), 1e-5)
    eye = torch.eye(k, dtype=h.dtype, device=h.device)
    for attempt in range(DAMP_RETRIES):
        try:
            lower = torch.linalg.cholesky(h + eye * base * (1 + attempt))  # more damping on each retry
            hinv = torch.cholesky_solve(eye, lower)  # = cholesky_inverse(lower), >10x faster on CPU
            return torch.linalg.cholesky(hinv, upper=True).contiguous()  # row-major: rows are read one by one
        except torch.linalg.LinAlgError:  # type: ignore[attr-defined]
            continue
    raise ModelFormatError(f"Hessian is not positive definite even after {DAMP_RETRIES} damping attempts")


@dataclass
class PreparedHessian:
    """Act-order permutation and the upper factor of (H + damping)^-1, shared by every option (and by q/k/v,
    gate/up) quantized against the same Hessian, so the K^3 work happens once. Lives on H's device."""

    perm: torch.Tensor  # [K] stored row -> original feature
    u: torch.Tensor  # [K, K] upper Cholesky factor of the permuted, damped inverse

    @classmethod
    def from_hessian(cls, h: torch.Tensor | None, k: int, device: torch.device | str | None = None) -> PreparedHessian:
        if h is None:
            h = torch.eye(k, device=device)
        h = h.to(device or h.device, torch.float32).clone()
        dead = torch.diag(h) == 0  # inputs that are always zero: any value works; make H invertible there
        h[dead, dead] = 1.0
        perm = act_order(h)
        return cls(perm, _upper_inverse_factor(h[perm][:, perm]))


def gptq_group_reference(w: torch.Tensor, u: torch.Tensor, scale: torch.Tensor, bits: int
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """GPTQ over the rows of one group (pure torch; reference of triton_kernels.gptq_group).

    w [rows, N] fp32 current weights, u [rows, rows] the group's block of the upper factor, scale [N] fp32
    runtime scales -> (q [rows, N] fp32 integral stored values, d [rows, N] fp32 fp16-exact dequantized values,
    e [rows, N] fp32 errors scaled by 1/U[r, r]). Each row is rounded, and its error is pushed onto the later
    rows of the group (outer product rounded, then subtracted: no fused multiply-add). `w` is not modified.
    """
    rows, n = w.shape
    z, maxq = 1 << (bits - 1), (1 << bits) - 1
    w = w.clone()
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    zero_col = scale == 0  # all-zero column in this group: scale 0, stored value z
    q, d, e = (torch.empty(rows, n, device=w.device) for _ in range(3))
    buf = torch.empty(rows, n, device=w.device)
    for r in range(rows):  # in-place ops on preallocated rows: this loop is the CPU converter's hot spot
        qr, dr, er = q[r], d[r], e[r]
        torch.div(w[r], safe, out=qr).round_().add_(z).clamp_(0, maxq).masked_fill_(zero_col, z)
        torch.sub(qr, z, out=dr).mul_(scale)
        dr.copy_(dr.half())  # exact fp32 product, one fp16 rounding (= runtime)
        torch.sub(w[r], dr, out=er).div_(u[r, r])
        if r + 1 < rows:
            upd = torch.mul(u[r, r + 1 :, None], er[None, :], out=buf[: rows - r - 1])  # [rows-r-1, N]
            w[r + 1 :].sub_(upd)  # error feedback inside the group
    return q, d, e


def gptq_quantize(key: str, weight: torch.Tensor, h: torch.Tensor | PreparedHessian | None, option: QuantOption,
                  bias: torch.Tensor | None = None, pack: bool = True) -> GPTQResult:
    """weight [N, K] HF layout; h [K, K] Hessian, a PreparedHessian, or None (identity: RTN in act order).

    Runs on weight's device (a GPU uses the triton group kernel when triton is installed). pack=False skips
    building the QTensor (the measurement only needs the dequantized weight)."""
    if weight.device.type == "cuda":
        tf32 = torch.backends.cuda.matmul.allow_tf32
        torch.backends.cuda.matmul.allow_tf32 = False  # the lazy updates stay fp32 even when the forwards use TF32
        try:
            return _gptq(key, weight, h, option, bias, pack)
        finally:
            torch.backends.cuda.matmul.allow_tf32 = tf32
    # Thousands of mid-sized ops per call: intra-op threading gains little here and, on a loaded machine, every
    # parallel region waits for a descheduled sibling thread (measured: 9x slower on 2 busy cores).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _gptq(key, weight, h, option, bias, pack)
    finally:
        torch.set_num_threads(threads)


def _gptq(key: str, weight: torch.Tensor, h, option: QuantOption, bias: torch.Tensor | None,
          pack: bool) -> GPTQResult:
    from exl2_backend.quant import triton_kernels

    n, k = weight.shape
    dev = weight.device
    if not torch.isfinite(weight).all():
        raise ModelFormatError("weight holds NaN or infinite values; cannot quantize", tensor=f"{key}.weight")
    prep = h if isinstance(h, PreparedHessian) else PreparedHessian.from_hessian(h, k, device=dev)
    perm, u = prep.perm.to(dev), prep.u.to(dev)
    w = weight.detach().float().t()[perm].contiguous()  # [K, N] stored (activation) order
    groups = option.group_layout(k)
    group_fn = triton_kernels.gptq_group if triton_kernels.available(dev) else gptq_group_reference

    np_ = pad32(n)
    qvalues = torch.empty(k, np_, dtype=torch.int32, device=dev)  # [K, Np]
    dq = torch.zeros(k, np_, dtype=torch.float16, device=dev)  # [K, Np] stored order; padding columns decode to 0
    codes = torch.zeros(len(groups), np_, dtype=torch.int32, device=dev)  # [G, Np]
    smax = torch.empty(len(groups), dtype=torch.float16, device=dev)  # [G]
    a = 0
    for g, (bits, rows) in enumerate(groups):
        b = a + rows
        c, m = search_group_scales(w[a:b], bits, check_finite=False)  # scales from the error-compensated weights
        codes[g, :n], smax[g] = c, m
        scale = runtime_scales(m.unsqueeze(0), codes[g : g + 1])[0, :n].float()  # [N], exactly the runtime's
        q, d, err = group_fn(w[a:b], u[a:b, a:b], scale, bits)  # [rows, N] each
        qvalues[a:b, :n] = q.to(torch.int32)
        dq[a:b, :n] = d.half()
        if b < k:
            w[b:].addmm_(u[a:b, b:].t(), err, alpha=-1)  # lazy block update of all later rows
        a = b
    check_scale_maxima(key, smax)
    qvalues[:, n:] = torch.tensor([z for bits, rows in groups for z in [1 << (bits - 1)] * rows],
                                  dtype=torch.int32, device=dev)[:, None]  # padding columns hold the zero point
    invperm = torch.argsort(perm)  # original feature i is stored at row invperm[i]
    qt = None
    if pack:
        qt = build_qtensor(key, qvalues.cpu(), codes.cpu(), smax.cpu(), groups, invperm.cpu().to(torch.int32), n,
                           bias=None if bias is None else bias.detach().cpu())
    return GPTQResult(qt, dq.index_select(0, invperm), out_features=n)
