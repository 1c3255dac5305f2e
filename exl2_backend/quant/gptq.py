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

from exl2_backend.errors import ModelFormatError, NonFiniteScaleError
from exl2_backend.format.build import build_qtensor
from exl2_backend.format.layout import QuantOption
from exl2_backend.format.qtensor import QTensor, pad32
from exl2_backend.quant.rtn import runtime_scales, search_group_scales

DAMP = 0.12  # relative damping of the Hessian diagonal (ExLlamaV2's value)
DAMP_RETRIES = 10


@dataclass
class GPTQResult:
    qtensor: QTensor
    dequant: torch.Tensor  # fp16 [K, Np], original feature order: what exl2_dequant(qtensor) returns

    def weight(self) -> torch.Tensor:
        """fp32 [N, K] HF layout of the quantized weight (for running the model on it)."""
        return self.dequant[:, : self.qtensor.out_features].float().t().contiguous()


class HessianAccumulator:
    """Running H = sum(x^T x) / n over calibration activations, fp32 (format doc d.5)."""

    def __init__(self, k: int):
        self.h = torch.zeros(k, k, dtype=torch.float32)
        self.n = 0

    def add(self, x: torch.Tensor) -> None:
        x = x.reshape(-1, x.shape[-1]).float()  # [tokens, K]
        self.h.addmm_(x.t(), x)
        self.n += x.shape[0]

    def result(self) -> torch.Tensor:
        return self.h / max(self.n, 1) if self.n else torch.eye(self.h.shape[0])


def act_order(h: torch.Tensor) -> torch.Tensor:
    """perm [K]: stored row k holds original feature perm[k] (descending diag(H); stable for ties)."""
    return torch.argsort(torch.diag(h), descending=True, stable=True)


def _upper_inverse_factor(h: torch.Tensor) -> torch.Tensor:
    """Upper Cholesky factor U of (H + damping)^-1, retrying with more damping when H is not PD."""
    k = h.shape[0]
    base = max(DAMP * float(torch.diag(h).mean()), 1e-5)
    eye = torch.eye(k, dtype=h.dtype)
    for attempt in range(DAMP_RETRIES):
        try:
            lower = torch.linalg.cholesky(h + eye * base * (1 + attempt))  # more damping on each retry
            hinv = torch.cholesky_inverse(lower)
            return torch.linalg.cholesky(hinv, upper=True)
        except torch.linalg.LinAlgError:  # type: ignore[attr-defined]
            continue
    raise ModelFormatError(f"Hessian is not positive definite even after {DAMP_RETRIES} damping attempts")


@dataclass
class PreparedHessian:
    """Act-order permutation and the upper factor of (H + damping)^-1, shared by every option (and by q/k/v,
    gate/up) quantized against the same Hessian, so the K^3 work happens once."""

    perm: torch.Tensor  # [K] stored row -> original feature
    u: torch.Tensor  # [K, K] upper Cholesky factor of the permuted, damped inverse

    @classmethod
    def from_hessian(cls, h: torch.Tensor | None, k: int) -> PreparedHessian:
        h = torch.eye(k) if h is None else h.float().clone()
        dead = torch.diag(h) == 0  # inputs that are always zero: any value works; make H invertible there
        h[dead, dead] = 1.0
        perm = act_order(h)
        return cls(perm, _upper_inverse_factor(h[perm][:, perm]))


def gptq_quantize(key: str, weight: torch.Tensor, h: torch.Tensor | PreparedHessian | None, option: QuantOption,
                  bias: torch.Tensor | None = None) -> GPTQResult:
    """weight [N, K] HF layout; h [K, K] Hessian, a PreparedHessian, or None (identity: RTN in act order)."""
    # Thousands of mid-sized ops per call: intra-op threading gains little here and, on a loaded machine, every
    # parallel region waits for a descheduled sibling thread (measured: 9x slower on 2 busy cores).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _gptq(key, weight, h, option, bias)
    finally:
        torch.set_num_threads(threads)


def _gptq(key: str, weight: torch.Tensor, h, option: QuantOption, bias: torch.Tensor | None) -> GPTQResult:
    n, k = weight.shape
    if not torch.isfinite(weight).all():
        raise ModelFormatError("weight holds NaN or infinite values; cannot quantize", tensor=f"{key}.weight")
    prep = h if isinstance(h, PreparedHessian) else PreparedHessian.from_hessian(h, k)
    perm, u = prep.perm, prep.u
    w = weight.detach().float().t()[perm].contiguous()  # [K, N] stored (activation) order
    groups = option.group_layout(k)

    np_ = pad32(n)
    qvalues = torch.empty(k, np_, dtype=torch.int32)  # [K, Np]
    dq = torch.zeros(k, np_, dtype=torch.float16)  # [K, Np] stored order; padding columns decode to 0
    codes = torch.zeros(len(groups), np_, dtype=torch.int32)  # [G, Np]
    smax = torch.empty(len(groups), dtype=torch.float16)  # [G]
    a = 0
    for g, (bits, rows) in enumerate(groups):
        b = a + rows
        z, maxq = 1 << (bits - 1), (1 << bits) - 1
        try:
            c, m = search_group_scales(w[a:b], bits)  # scales from the error-compensated weights
        except NonFiniteScaleError as e:
            raise NonFiniteScaleError(f"group {g}: {e}", tensor=f"{key}.q_scale_max") from None
        codes[g, :n], smax[g] = c, m
        scale = runtime_scales(m.unsqueeze(0), codes[g : g + 1])[0, :n].float()  # [N], exactly the runtime's
        safe = torch.where(scale > 0, scale, torch.ones_like(scale))
        zero_col = scale == 0  # all-zero column in this group: scale 0, stored value z
        err = torch.empty(rows, n)  # [rows, N] scaled errors of this group
        qg = torch.empty(rows, n)  # [rows, N] quantized values (float, converted once per group)
        dg = torch.empty(rows, n)  # [rows, N] dequantized values (fp16-exact, held in fp32)
        for r in range(a, b):  # in-place ops on preallocated rows: this loop is the converter's hot spot
            q, d, e = qg[r - a], dg[r - a], err[r - a]
            torch.div(w[r], safe, out=q).round_().add_(z).clamp_(0, maxq).masked_fill_(zero_col, z)
            torch.sub(q, z, out=d).mul_(scale)
            d.copy_(d.half())  # exact fp32 product, one fp16 rounding (= runtime)
            torch.sub(w[r], d, out=e).div_(u[r, r])
            w[r + 1 : b].addr_(u[r, r + 1 : b], e, alpha=-1)  # error feedback inside the group
        qvalues[a:b, :n] = qg.to(torch.int32)
        dq[a:b, :n] = dg.half()
        if b < k:
            w[b:] -= u[a:b, b:].t() @ err  # lazy block update of all later rows
        a = b
    qvalues[:, n:] = torch.tensor([z for bits, rows in groups for z in [1 << (bits - 1)] * rows],
                                  dtype=torch.int32)[:, None]  # padding columns hold the zero point
    invperm = torch.argsort(perm).to(torch.int32)  # original feature i is stored at row invperm[i]
    qt = build_qtensor(key, qvalues, codes, smax, groups, invperm, n, bias=bias)
    return GPTQResult(qt, dq.index_select(0, invperm.long()))
