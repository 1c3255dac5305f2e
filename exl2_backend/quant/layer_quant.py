"""Quant-pass steps: calibration rows, one decoder layer with its chosen options, and the head.

Everything runs on the device of the hidden states; the EXL2 tensors come back on the CPU for writing.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import torch
import torch.nn.functional as F

from exl2_backend.errors import ConfigError, ModelFormatError
from exl2_backend.format.layout import HEAD_OPTIONS
from exl2_backend.format.writer import qtensor_tensors
from exl2_backend.ops import reference as ops
from exl2_backend.quant.blocks import (
    BLOCK_PROJS,
    FIRST_INPUT,
    HESSIAN_SOURCE,
    LAST_INPUT,
    block_core,
    block_input,
    block_output,
    dense_weights,
    row_chunks,
)
from exl2_backend.quant.gptq import HessianAccumulator, act_order, gptq_quantize
from exl2_backend.quant.measure import block_key, hessians, record_options
from exl2_backend.quant.rtn import quantize_rtn

RTN_HEAD_NUMEL = 10**9  # heads larger than this are quantized round-to-nearest (format doc c)
METHODS = ("gptq", "rtn")


def calibration_ids(model_dir: Path, cfg, cal_files, rows: int, length: int,
                    texts: list[str] | None = None) -> tuple[torch.Tensor, str]:
    """int64 [rows, length] token ids cut at evenly spaced offsets of the calibration text (calibration.py's
    `calibration_rows`): the built-in set, the users' `cal_files`, or `texts` given directly."""
    from exl2_backend.quant.calibration import calibration_rows, load_calibration_texts
    from exl2_backend.tokenizer import Tokenizer

    if texts is None:
        texts = load_calibration_texts(list(cal_files) if cal_files else None)
        name = ",".join(Path(f).name for f in cal_files) if cal_files else "(default)"
    else:
        name = "(given)"
    if not any(t.strip() for t in texts):
        raise ConfigError("calibration text is empty", field="cal")
    ids = calibration_rows(Tokenizer.from_dir(model_dir), texts, rows, length)
    return ids.clamp_(0, cfg.vocab_size - 1), name


def spread(n: int, k: int) -> torch.Tensor:
    """k indices spread evenly over range(n) (k <= n), first and last included."""
    if k >= n:
        return torch.arange(n)
    return torch.tensor([round(i * (n - 1) / max(1, k - 1)) for i in range(k)]) if k > 1 else torch.tensor([0])


def check_packed(qt, dequant: torch.Tensor) -> None:
    """The packed tensors must decode (reference exl2_dequant) to exactly the values the quantizer intended
    (fp16 [K, Np]); ExLlamaV2's converter makes the same check with a tolerance. Columns decode independently,
    so the first and last 32 columns are checked: cheap next to the quantization even for an 8B model."""
    from exl2_backend.ops.reference import exl2_dequant

    np_ = qt.padded_out_features
    for c0 in sorted({0, np_ - 32}):
        part = replace(qt, q_weight=qt.q_weight[:, c0 : c0 + 32], q_scale=qt.q_scale[:, c0 // 8 : c0 // 8 + 4],
                       out_features=32, bias=None, _groups=None)
        if not torch.equal(exl2_dequant(part), dequant[:, c0 : c0 + 32].cpu()):
            raise ModelFormatError("packed tensors do not decode to the quantized values", tensor=qt.key)


def _quantize(key: str, weight: torch.Tensor, hessian, option, bias, method: str, on_linear=None):
    """(EXL2 tensors, dequantized fp32 [N, K] weight on weight's device) of one linear."""
    if method == "rtn":  # no act-order, no error feedback: the plain baseline
        qt = quantize_rtn(key, weight, option, bias=bias)
        from exl2_backend.ops.reference import exl2_dequant

        dequant = exl2_dequant(qt).to(weight.device)  # fp16 [K, Np]
    else:
        res = gptq_quantize(key, weight, hessian, option, bias=bias)
        qt, dequant = res.qtensor, res.dequant
        check_packed(qt, dequant)
    if on_linear is not None:
        on_linear(key, dequant)
    return qtensor_tensors(qt), dequant[:, : weight.shape[0]].float().t().contiguous()


def quantize_layer(i: int, x: torch.Tensor, lw, cfg, inv_freq, strategy: dict, method: str = "gptq",
                   on_linear: Callable[[str, torch.Tensor], None] | None = None) -> tuple[dict, torch.Tensor]:
    """x [R, T, H] (quantized model's stream) -> (EXL2 tensors of layer i, output stream [R, T, H]).

    Per block: q/k/v (gate/up) get one Hessian from the normed block input; o (down) gets its Hessian from
    the activations produced by the already-quantized first projections, which also give the block output.
    `on_linear(key, dequant fp16 [K, Np])` sees the values each linear is meant to decode to."""
    out: dict[str, torch.Tensor] = {}
    for kind in ("attn", "mlp"):
        opts = record_options(strategy[block_key(i, kind)], kind)
        projs = BLOCK_PROJS[kind]
        w = dense_weights(lw, projs, x.device)
        xn = [block_input(kind, xc, lw, cfg) for xc in row_chunks(x)]  # [r*T, H] per chunk
        hs = hessians({FIRST_INPUT[kind]: xn}) if method == "gptq" else {}
        for proj in projs[:-1]:
            key = f"{block_key(i, kind)}.{proj}"
            tensors, w[proj] = _quantize(key, w[proj], hs.get(HESSIAN_SOURCE[proj]), opts[proj],
                                         w.get(f"{proj}.bias"), method, on_linear)
            out.update(tensors)
        a = [block_core(kind, xnc, xc.shape[0], w, cfg, inv_freq) for xc, xnc in zip(row_chunks(x), xn)]
        del xn
        last = projs[-1]
        hs = hessians({LAST_INPUT[kind]: a}) if method == "gptq" else {}
        key = f"{block_key(i, kind)}.{last}"
        tensors, w[last] = _quantize(key, w[last], hs.get(LAST_INPUT[kind]), opts[last], w.get(f"{last}.bias"),
                                     method, on_linear)
        out.update(tensors)
        x = torch.cat([block_output(kind, xc, ac, w) for xc, ac in zip(row_chunks(x), a)])
    return out, x


def quantize_head(weight: torch.Tensor, x: torch.Tensor, norm: torch.Tensor, cfg, ids: torch.Tensor,
                  head_bits: int, method: str = "gptq", on_linear=None) -> tuple[dict, float]:
    """GPTQ (RTN above 1e9 weights, or with method "rtn") of the head from the final hidden states x [R, T, H];
    returns (tensors, calibration perplexity of the first rows; a sanity number, > 30 is suspect)."""
    dev = x.device
    weight = weight.to(dev, torch.float32)
    xn = [ops.rms_norm(c.reshape(-1, c.shape[-1]), norm.to(dev), cfg.rms_norm_eps) for c in x.split(4)]
    option = HEAD_OPTIONS[head_bits]
    if method == "rtn":
        tensors, w_q = _quantize("lm_head", weight, None, option, None, "rtn", on_linear)
    else:
        acc = HessianAccumulator(cfg.hidden_size, dev)
        for c in xn:
            acc.add(c)
        if weight.numel() > RTN_HEAD_NUMEL:
            qt = quantize_rtn("lm_head", weight, option, perm=act_order(acc.result()))
            from exl2_backend.ops.reference import exl2_dequant

            dequant = exl2_dequant(qt).to(dev)
            if on_linear is not None:
                on_linear("lm_head", dequant)
            tensors, w_q = qtensor_tensors(qt), dequant[:, : weight.shape[0]].float().t()
        else:
            tensors, w_q = _quantize("lm_head", weight, acc.result(), option, None, "gptq", on_linear)
    r = min(2, ids.shape[0], x.split(4)[0].shape[0])
    t = ids.shape[1]
    logits = xn[0][: r * t] @ w_q.t()  # [r*T, V]
    lg = logits.reshape(r, t, -1)[:, :-1].reshape(-1, logits.shape[-1])
    ppl = float(torch.exp(F.cross_entropy(lg, ids[:r, 1:].reshape(-1).to(dev))))
    return tensors, ppl if math.isfinite(ppl) else float("nan")
