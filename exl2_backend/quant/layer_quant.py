"""Quant-pass steps: calibration rows, one decoder layer with its chosen options, and the head."""

from __future__ import annotations

import math
from pathlib import Path

import torch
import torch.nn.functional as F

from exl2_backend import ops
from exl2_backend.errors import ConfigError
from exl2_backend.format.layout import HEAD_OPTIONS
from exl2_backend.format.writer import qtensor_tensors
from exl2_backend.quant.blocks import BLOCK_PROJS, HESSIAN_SOURCE, dense_weights, run_block
from exl2_backend.quant.gptq import HessianAccumulator, act_order, gptq_quantize
from exl2_backend.quant.measure import block_key, hessians, record_options
from exl2_backend.quant.rtn import quantize_rtn

RTN_HEAD_NUMEL = 10**9  # heads larger than this are quantized round-to-nearest (format doc c)


def _texts(cal_files, texts: list[str] | None) -> tuple[list[str], str]:
    if texts is not None:
        return texts, "(given)"
    try:
        from exl2_backend.quant.calibration import load_calibration_texts
    except ImportError:
        load_calibration_texts = None
    if load_calibration_texts is not None:
        out = load_calibration_texts(list(cal_files) if cal_files else None)
    elif cal_files:  # plain-text fallback while the calibration module is absent
        out = [Path(f).read_text(encoding="utf-8", errors="replace") for f in cal_files]
    else:
        raise ConfigError("no built-in calibration text available; pass --cal FILE", field="cal")
    name = ",".join(Path(f).name for f in cal_files) if cal_files else "(default)"
    return out, name


def calibration_rows(model_dir: Path, cfg, s, texts: list[str] | None = None) -> tuple[torch.Tensor, str]:
    """int64 [max(rows, measure_rows), length] token ids from the calibration texts (cycled if too short)."""
    from exl2_backend.tokenizer import Tokenizer

    texts, name = _texts(s.cal_files, texts)
    tok = Tokenizer.from_dir(model_dir)
    ids: list[int] = []
    for t in texts:
        ids += tok.encode(t, add_special_tokens=False)
    if not ids:
        raise ConfigError("calibration text tokenizes to nothing", field="cal")
    rows = max(s.rows, s.measure_rows)
    need = rows * s.length
    stream = torch.tensor(ids * math.ceil(need / len(ids)), dtype=torch.int64)[:need]
    return stream.clamp_(0, cfg.vocab_size - 1).reshape(rows, s.length), name


def quantize_layer(i: int, x: torch.Tensor, lw, cfg, inv_freq, strategy: dict) -> tuple[dict, torch.Tensor]:
    """x [R, T, H] (quantized model's stream) -> (EXL2 tensors of layer i, output stream [R, T, H]).

    Per block: q/k/v (gate/up) get one Hessian from the block input; o (down) gets its Hessian from the
    activations produced by the already-quantized first projections."""
    out: dict[str, torch.Tensor] = {}
    for kind in ("attn", "mlp"):
        opts = record_options(strategy[block_key(i, kind)], kind)
        projs = BLOCK_PROJS[kind]
        w = dense_weights(lw, projs)
        for stage in (projs[:-1], projs[-1:]):
            cap: dict = {}
            run_block(kind, x, lw, w, cfg, inv_freq, cap)
            hs = hessians({HESSIAN_SOURCE[p]: cap[HESSIAN_SOURCE[p]] for p in stage})
            for proj in stage:
                key = f"{block_key(i, kind)}.{proj}"
                res = gptq_quantize(key, w[proj], hs[HESSIAN_SOURCE[proj]], opts[proj], bias=w.get(f"{proj}.bias"))
                out.update(qtensor_tensors(res.qtensor))
                w[proj] = res.weight()
        x = run_block(kind, x, lw, w, cfg, inv_freq)
    return out, x


def quantize_head(weight: torch.Tensor, x: torch.Tensor, norm: torch.Tensor, cfg, ids: torch.Tensor,
                  head_bits: int) -> tuple[dict, float]:
    """GPTQ (RTN above 1e9 weights) of the head from the final hidden states; returns (tensors, cal. ppl)."""
    acc = HessianAccumulator(cfg.hidden_size)
    xn = [ops.rms_norm(c.reshape(-1, c.shape[-1]), norm, cfg.rms_norm_eps) for c in x.split(4)]
    for c in xn:
        acc.add(c)
    option = HEAD_OPTIONS[head_bits]
    if weight.numel() > RTN_HEAD_NUMEL:
        qt = quantize_rtn("lm_head", weight, option, perm=act_order(acc.result()))
        from exl2_backend.ops.reference import exl2_dequant

        w_q = exl2_dequant(qt)[:, : weight.shape[0]].float().t()
    else:
        res = gptq_quantize("lm_head", weight, acc.result(), option)
        qt, w_q = res.qtensor, res.weight()
    # calibration perplexity of the quantized model on the first rows (a sanity number, >30 is suspect)
    r = min(2, ids.shape[0])
    logits = xn[0][: r * ids.shape[1]] @ w_q.t() if xn[0].shape[0] >= r * ids.shape[1] else None
    ppl = float("nan")
    if logits is not None:
        tgt = ids[:r, 1:].reshape(-1)
        lg = logits.reshape(r, ids.shape[1], -1)[:, :-1].reshape(-1, logits.shape[-1])
        ppl = float(torch.exp(F.cross_entropy(lg, tgt)))
    return qtensor_tensors(qt), ppl
