"""fp32 forward of one Llama decoder block over calibration rows, exposing the inputs each linear sees.

The converter needs the activations entering every projection (for Hessians) and the block outputs (for
measurement), on full causal rows with no KV cache, so it uses this small functional version instead of the
paged-cache model. Weights are dicts of fp32 HF-layout tensors: {"q_proj": [N, K], "q_proj.bias": [N], ...}.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from exl2_backend import ops
from exl2_backend.format.reader import ATTN_PROJS, MLP_PROJS, DenseLinear, LayerWeights

Weights = dict[str, torch.Tensor]


def dense_weights(lw: LayerWeights, projs: tuple[str, ...]) -> Weights:
    """fp32 copies of the dense linears `projs` of one layer (and their biases)."""
    out: Weights = {}
    for p in projs:
        lin = getattr(lw, p)
        if not isinstance(lin, DenseLinear):
            raise TypeError(f"{p} is already quantized")
        out[p] = lin.weight.float()
        if lin.bias is not None:
            out[f"{p}.bias"] = lin.bias.float()
    return out


def _lin(x: torch.Tensor, w: Weights, name: str) -> torch.Tensor:
    return F.linear(x, w[name], w.get(f"{name}.bias"))


def attention_block(x: torch.Tensor, norm: torch.Tensor, w: Weights, cfg, inv_freq: torch.Tensor,
                    capture: dict | None = None) -> torch.Tensor:
    """x [R, T, H] residual stream -> x + attn(rms_norm(x)). capture gets "q_proj" (normed input) and
    "o_proj" (attention output before o) when given; a present key is overwritten."""
    r, t, _ = x.shape
    hq, hkv, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    xn = ops.rms_norm(x.reshape(r * t, -1), norm, cfg.rms_norm_eps)  # [R*T, H]
    pos = torch.arange(t).repeat(r)  # [R*T]
    q = ops.apply_rope(_lin(xn, w, "q_proj").reshape(r * t, hq, d), pos, inv_freq)
    k = ops.apply_rope(_lin(xn, w, "k_proj").reshape(r * t, hkv, d), pos, inv_freq)
    v = _lin(xn, w, "v_proj").reshape(r * t, hkv, d)
    q, k, v = (z.reshape(r, t, -1, d).transpose(1, 2) for z in (q, k, v))  # [R, heads, T, D]
    k, v = k.repeat_interleave(hq // hkv, dim=1), v.repeat_interleave(hq // hkv, dim=1)  # GQA
    a = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # [R, Hq, T, D]
    a = a.transpose(1, 2).reshape(r * t, hq * d)
    if capture is not None:
        capture["q_proj"], capture["o_proj"] = xn, a
    return x + _lin(a, w, "o_proj").reshape(r, t, -1)


def mlp_block(x: torch.Tensor, norm: torch.Tensor, w: Weights, cfg, capture: dict | None = None) -> torch.Tensor:
    """x [R, T, H] -> x + down(silu(gate(xn)) * up(xn)); capture gets "up_proj" and "down_proj" inputs."""
    r, t, _ = x.shape
    xn = ops.rms_norm(x.reshape(r * t, -1), norm, cfg.rms_norm_eps)  # [R*T, H]
    a = ops.silu_mul(_lin(xn, w, "gate_proj"), _lin(xn, w, "up_proj"))  # [R*T, I]
    if capture is not None:
        capture["up_proj"], capture["down_proj"] = xn, a
    return x + _lin(a, w, "down_proj").reshape(r, t, -1)


def run_block(kind: str, x: torch.Tensor, lw: LayerWeights, w: Weights, cfg, inv_freq, capture=None):
    """kind "attn" or "mlp"; norms come from `lw`, linears from `w`. Runs in row chunks to bound memory."""
    outs = []
    for i in range(0, x.shape[0], 8):
        cap = {} if capture is not None else None
        if kind == "attn":
            outs.append(attention_block(x[i : i + 8], lw.input_layernorm, w, cfg, inv_freq, cap))
        else:
            outs.append(mlp_block(x[i : i + 8], lw.post_attention_layernorm, w, cfg, cap))
        if capture is not None:
            for name, t in cap.items():
                capture.setdefault(name, []).append(t)
    return torch.cat(outs)


BLOCK_PROJS = {"attn": ATTN_PROJS, "mlp": MLP_PROJS}
HESSIAN_SOURCE = {"q_proj": "q_proj", "k_proj": "q_proj", "v_proj": "q_proj", "o_proj": "o_proj",
                  "gate_proj": "up_proj", "up_proj": "up_proj", "down_proj": "down_proj"}  # shared Hessians
