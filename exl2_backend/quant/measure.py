"""Measurement pass (format doc d.3): accuracy and storage cost of every option of every block.

For each decoder layer's attention and MLP block: run the FP16 block on the calibration rows (fp32 math),
build the shared Hessians, GPTQ-quantize each projection once per distinct option, then for each combined
option run the block with those weights and record accuracy = 1 - mean_tokens(|y_q - y_ref| / |y_ref|). The
next block's input is the FP16 reference output. Results use measurement.json's record shape (doc a.5).
Everything runs on the device of the hidden states (GPU or CPU).

The error is relative *per token*, where ExLlamaV2 takes it per row (|.|_F over a whole 2048-token row). Each
token's next input is normalized by its own RMS, so the per-token ratio is the relative perturbation the next
block sees; a row-wide ratio lets a few tokens with massive activations hide everyone else's error. Measured on
SmolLM2-135M: from layer 11 on, a handful of tokens make the residual's RMS jump 7x, and per-row errors of the
later blocks came out 5-7x smaller than per-token ones, so the optimizer starved those layers of bits.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from exl2_backend.format.layout import ATTENTION_OPTIONS, MLP_OPTIONS, QuantOption
from exl2_backend.format.reader import LayerWeights, linear_shape
from exl2_backend.quant.blocks import (
    BLOCK_PROJS,
    FIRST_INPUT,
    HESSIAN_SOURCE,
    block_core,
    block_output,
    dense_weights,
    row_chunks,
    run_block,
)
from exl2_backend.quant.gptq import HessianAccumulator, PreparedHessian, gptq_quantize

OPTION_TABLES = {"attn": ATTENTION_OPTIONS, "mlp": MLP_OPTIONS}
MODE = {"attn": "self_attn", "mlp": "mlp"}
# Default measured subsets ("default"): 11 options per block spanning the bpw range, about half the GPTQ work of
# all 19/17 (ExLlamaV2 measures all; pass "all" for that).
DEFAULT_OPTIONS = {"attn": (0, 2, 3, 4, 6, 8, 10, 12, 14, 16, 18), "mlp": (0, 2, 3, 4, 6, 7, 9, 11, 13, 14, 16)}


def block_key(layer: int, kind: str) -> str:
    return f"model.layers.{layer}.{MODE[kind]}"


def hessians(capture: dict[str, list[torch.Tensor]]) -> dict[str, PreparedHessian]:
    """Prepared (permuted, factored) Hessian per captured input name, on the activations' device."""
    out = {}
    for name, chunks in capture.items():
        acc = HessianAccumulator(chunks[0].shape[-1], chunks[0].device)
        for c in chunks:
            acc.add(c)
        out[name] = PreparedHessian.from_hessian(acc.result(), acc.h.shape[0])
    return out


class TokenErrors:
    """Accumulates per-token relative errors |y_t - ref_t| / |ref_t| over row chunks (no full y is kept)."""

    def __init__(self):
        self.parts: list[torch.Tensor] = []

    def add(self, y: torch.Tensor, ref: torch.Tensor) -> None:
        """y, ref [r, T, H]."""
        self.parts.append(((y - ref).norm(dim=-1) / ref.norm(dim=-1).clamp_min(1e-10)).flatten())  # [r*T]

    def mean(self) -> float:
        """Mean over all tokens (one host sync)."""
        return float(torch.cat(self.parts).mean())


def measure_block(kind: str, x: torch.Tensor, lw: LayerWeights, cfg, inv_freq,
                  option_ids: Sequence[int] | None = None, step: Callable[[], None] | None = None
                  ) -> tuple[list[dict], torch.Tensor]:
    """x [R, T, H] -> (records for the block's options, FP16 reference output [R, T, H]), on x's device."""
    projs = BLOCK_PROJS[kind]
    table = OPTION_TABLES[kind]
    ids = list(range(len(table))) if option_ids is None else list(option_ids)
    w_ref = dense_weights(lw, projs, x.device)
    capture: dict = {}
    y_ref = run_block(kind, x, lw, w_ref, cfg, inv_freq, capture)
    xn = capture[FIRST_INPUT[kind]]  # normed block input per row chunk: the same for every option
    hs = hessians(capture)
    del capture
    cache: dict[tuple[str, str], torch.Tensor] = {}  # (proj, option) -> fp32 [N, K] dequantized weight
    records = []
    for i in ids:
        w_q = dict(w_ref)
        bits = 0
        rec: dict = {}
        for proj, opt in zip(projs, table[i]):
            ck = (proj, str(opt))
            if ck not in cache:  # options repeat across rows of the table: quantize each once
                res = gptq_quantize(proj, w_ref[proj], hs[HESSIAN_SOURCE[proj]], opt, bias=w_ref.get(f"{proj}.bias"),
                                    pack=False)
                cache[ck] = res.weight()
            w_q[proj] = cache[ck]
            k, n = linear_shape(cfg, proj)
            bits += opt.total_bits(k, n, bias=cfg.has_bias(proj))
            rec[proj] = opt.to_json()
        err = TokenErrors()
        for xc, xnc, yc in zip(row_chunks(x), xn, row_chunks(y_ref)):
            a = block_core(kind, xnc, xc.shape[0], w_q, cfg, inv_freq)
            err.add(block_output(kind, xc, a, w_q), yc)
        accuracy = max(1.0 - err.mean(), 1e-6)
        records.append({"accuracy": accuracy, "total_bits": int(bits), "option_index": i, **rec})
        if step is not None:
            step()
    return records, y_ref


def record_options(rec: dict, kind: str) -> dict[str, QuantOption]:
    """The per-projection options of a measurement/strategy record."""
    return {p: QuantOption.from_json(rec[p]) for p in BLOCK_PROJS[kind]}


def parse_option_ids(text: str | None, kind: str) -> list[int] | None:
    """"all"/None -> None (every option); "default" -> DEFAULT_OPTIONS; "0,6,9" -> indices (validated)."""
    if text is None or text.strip().lower() == "all":
        return None
    if text.strip().lower() == "default":
        return list(DEFAULT_OPTIONS[kind])
    n = len(OPTION_TABLES[kind])
    try:
        ids = sorted({int(t) for t in text.split(",") if t.strip()})
    except ValueError:
        raise ValueError(f"bad {kind} option list {text!r}: want comma-separated indices or 'all'") from None
    if not ids or ids[0] < 0 or ids[-1] >= n:
        raise ValueError(f"{kind} option indices must be within 0..{n - 1}, got {text!r}")
    return ids
