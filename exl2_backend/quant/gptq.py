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


def gptq_quantize(key: str, weight: torch.Tensor, h: torch.Tensor | None, option: QuantOption,
                  bias: torch.Tensor | None = None) -> GPTQResult:
    """weight [N, K] HF layout, h [K, K] (None: identity, i.e. plain RTN-like behaviour in act order)."""
    n, k = weight.shape
    if not torch.isfinite(weight).all():
        raise ModelFormatError("weight holds NaN or infinite values; cannot quantize", tensor=f"{key}.weight")
    h = torch.eye(k) if h is None else h.float().clone()
    w = weight.detach().float().t().clone()  # [K, N]
    dead = torch.diag(h) == 0  # inputs that are always zero: any value works; make H invertible there
    h[dead, dead] = 1.0
    perm = act_order(h)
    h = h[perm][:, perm]
    w = w[perm]  # stored order
    u = _upper_inverse_factor(h)  # [K, K]
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
        err = torch.empty(rows, n)  # [rows, N] scaled errors of this group
        for r in range(a, b):
            q = torch.clamp(torch.round(w[r] / safe) + z, 0, maxq)
            q = torch.where(scale > 0, q, torch.full_like(q, z))  # all-zero column group: scale 0, value z
            d = ((q - z) * scale).half()  # exact fp32 product, one fp16 rounding (= runtime)
            e = (w[r] - d.float()) / u[r, r]
            w[r + 1 : b] -= u[r, r + 1 : b, None] * e[None, :]  # error feedback inside the group
            err[r - a] = e
            qvalues[r, :n] = q.to(torch.int32)
            dq[r, :n] = d
        if b < k:
            w[b:] -= u[a:b, b:].t() @ err  # lazy block update of all later rows
        a = b
    qvalues[:, n:] = torch.tensor([z for bits, rows in groups for z in [1 << (bits - 1)] * rows],
                                  dtype=torch.int32)[:, None]  # padding columns hold the zero point
    invperm = torch.argsort(perm).to(torch.int32)  # original feature i is stored at row invperm[i]
    qt = build_qtensor(key, qvalues, codes, smax, groups, invperm, n, bias=bias)
    return GPTQResult(qt, dq.index_select(0, invperm.long()))
