"""fp32 forward of one Llama decoder block over calibration rows, in pieces that expose each linear's input.

The converter needs the activations entering every projection (for Hessians) and the block outputs (for
measurement), on full causal rows with no KV cache, so it uses this small functional version instead of the
paged-cache model. Pure torch (the reference ops) on whatever device the tensors are on. Weights are dicts of
fp32 HF-layout tensors: {"q_proj": [N, K], "q_proj.bias": [N], ...}.

A block is `y = x + last(core(norm(x)))`: `block_input` is the input of the first projections (q/k/v or
gate/up), `block_core` runs them and returns the input of the last one (o or down), `block_output` adds the
last projection to the residual. The pieces work on row chunks ([R, T, H] with R <= ROW_CHUNK) to bound memory.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.nn.functional as F

from exl2_backend.format.reader import ATTN_PROJS, MLP_PROJS, DenseLinear, LayerWeights
from exl2_backend.ops import reference as ops

Weights = dict[str, torch.Tensor]
ROW_CHUNK = 8  # calibration rows per piece of work

BLOCK_PROJS = {"attn": ATTN_PROJS, "mlp": MLP_PROJS}
HESSIAN_SOURCE = {"q_proj": "q_proj", "k_proj": "q_proj", "v_proj": "q_proj", "o_proj": "o_proj",
                  "gate_proj": "up_proj", "up_proj": "up_proj", "down_proj": "down_proj"}  # shared Hessians
FIRST_INPUT = {"attn": "q_proj", "mlp": "up_proj"}  # Hessian name of the block input (normed x)
LAST_INPUT = {"attn": "o_proj", "mlp": "down_proj"}  # Hessian name of the last projection's input


def dense_weights(lw: LayerWeights, projs: tuple[str, ...], device: torch.device | str = "cpu") -> Weights:
    """fp32 copies on `device` of the dense linears `projs` of one layer (and their biases)."""
    out: Weights = {}
    for p in projs:
        lin = getattr(lw, p)
        if not isinstance(lin, DenseLinear):
            raise TypeError(f"{p} is already quantized")
        out[p] = lin.weight.to(device, torch.float32)
        if lin.bias is not None:
            out[f"{p}.bias"] = lin.bias.to(device, torch.float32)
    return out


def _lin(x: torch.Tensor, w: Weights, name: str) -> torch.Tensor:
    return F.linear(x, w[name], w.get(f"{name}.bias"))


def row_chunks(x: torch.Tensor) -> Iterator[torch.Tensor]:
    """x [R, T, H] -> views of at most ROW_CHUNK rows."""
    return iter(x.split(ROW_CHUNK))


def block_input(kind: str, x: torch.Tensor, lw: LayerWeights, cfg) -> torch.Tensor:
    """x [r, T, H] -> rms_norm(x) [r*T, H]: the input of q/k/v ("attn") or gate/up ("mlp")."""
    norm = lw.input_layernorm if kind == "attn" else lw.post_attention_layernorm
    return ops.rms_norm(x.reshape(-1, x.shape[-1]), norm.to(x.device), cfg.rms_norm_eps)


def block_core(kind: str, xn: torch.Tensor, rows: int, w: Weights, cfg, inv_freq: torch.Tensor) -> torch.Tensor:
    """xn [rows*T, H] normed input -> the last projection's input: attention output [rows*T, Hq*D] ("attn")
    or silu(gate) * up [rows*T, I] ("mlp")."""
    if kind == "mlp":
        return ops.silu_mul(_lin(xn, w, "gate_proj"), _lin(xn, w, "up_proj"))
    t = xn.shape[0] // rows
    hq, hkv, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    pos = torch.arange(t, device=xn.device).repeat(rows)  # [rows*T]
    q = ops.apply_rope(_lin(xn, w, "q_proj").reshape(rows * t, hq, d), pos, inv_freq)
    k = ops.apply_rope(_lin(xn, w, "k_proj").reshape(rows * t, hkv, d), pos, inv_freq)
    v = _lin(xn, w, "v_proj").reshape(rows * t, hkv, d)
    q, k, v = (z.reshape(rows, t, -1, d).transpose(1, 2) for z in (q, k, v))  # [rows, heads, T, D]
    k, v = k.repeat_interleave(hq // hkv, dim=1), v.repeat_interleave(hq // hkv, dim=1)  # GQA
    a = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # [rows, Hq, T, D]
    return a.transpose(1, 2).reshape(rows * t, hq * d)


def block_output(kind: str, x: torch.Tensor, a: torch.Tensor, w: Weights) -> torch.Tensor:
    """x [r, T, H] residual, a [r*T, K] last projection's input -> x + last(a) [r, T, H]."""
    return x + _lin(a, w, BLOCK_PROJS[kind][-1]).reshape(x.shape)


def run_block(kind: str, x: torch.Tensor, lw: LayerWeights, w: Weights, cfg, inv_freq: torch.Tensor,
              capture: dict | None = None) -> torch.Tensor:
    """x [R, T, H] -> x + block(x) [R, T, H], by row chunks. `capture` (when given) gets lists of chunks under
    FIRST_INPUT[kind] (the normed input) and LAST_INPUT[kind] (the last projection's input)."""
    outs = []
    for xc in row_chunks(x):
        xn = block_input(kind, xc, lw, cfg)
        a = block_core(kind, xn, xc.shape[0], w, cfg, inv_freq)
        if capture is not None:
            capture.setdefault(FIRST_INPUT[kind], []).append(xn)
            capture.setdefault(LAST_INPUT[kind], []).append(a)
        outs.append(block_output(kind, xc, a, w))
    return torch.cat(outs)
