"""`LlamaModel`: the Llama-family forward pass over a paged KV cache, built only from `exl2_backend.ops`.

Covers Llama 2/3/3.1/3.2 (llama3 / linear RoPE scaling), Mistral, Qwen2/2.5 (q/k/v bias, carried by the
linears) and SmolLM/SmolLM2 (tied embeddings: no lm_head, the embedding matrix is the head). Unsupported
architectures never get here: `ModelConfig` refuses them.
"""

from __future__ import annotations

from pathlib import Path

import torch

from exl2_backend import ops
from exl2_backend.model.layers import AttentionMetadata, DecoderLayer, StepInputs, norm_linear, norm_qkv


def compute_dtype(device: torch.device, dtype: torch.dtype) -> torch.dtype:
    """Activation dtype: fp32 on CPU (fp16 matmuls there are slow and less accurate), `dtype` elsewhere."""
    return torch.float32 if device.type == "cpu" else dtype


class LlamaModel:
    """Weights prepared for `device`; `forward` runs one step for B sequences of Tq new tokens each."""

    def __init__(self, config, weights, device: str | torch.device, dtype: torch.dtype = torch.float16):
        self.config = config
        self.device = torch.device(device)
        self.dtype = compute_dtype(self.device, dtype)
        self.vocab_size = config.vocab_size
        self.num_layers = config.num_hidden_layers
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.eps = config.rms_norm_eps
        self.embed = weights.embed_tokens.to(device=self.device, dtype=self.dtype)  # [V', H]
        self.norm = weights.norm.to(device=self.device, dtype=self.dtype)  # [H]
        self.layers = [DecoderLayer(i, config, lw, self.device, self.dtype) for i, lw in enumerate(weights.layers)]
        # Tied embeddings (lm_head None): the head is a dense matmul against the embedding table itself.
        self.lm_head = None if weights.lm_head is None else ops.prepare_linear([weights.lm_head], self.device,
                                                                               self.dtype)
        self.inv_freq = ops.rope_inv_freq(config.head_dim, config.rope_theta, config.rope_scaling).to(self.device)

    @classmethod
    def from_dir(cls, model_dir: str | Path, device: str | torch.device = "cpu",
                 dtype: torch.dtype = torch.float16) -> LlamaModel:
        """Read config.json and the weights (EXL2 or FP16) of `model_dir` and prepare them on `device`."""
        from exl2_backend.format.config import ModelConfig
        from exl2_backend.format.reader import load_weights

        config = ModelConfig.from_dir(model_dir)
        return cls(config, load_weights(model_dir, config), device, dtype)

    def make_cache(self, num_pages: int, page_size: int, dtype: torch.dtype | None = None, cache_type: str = "fp16"):
        """A `PagedKVCache` shaped for this model (fp16-type storage dtype defaults to the activation dtype;
        cache_type fp8/q8/q6/q4 stores quantized pages)."""
        from exl2_backend.cache import PagedKVCache

        return PagedKVCache(self.num_layers, num_pages, page_size, self.num_kv_heads, self.head_dim,
                            dtype or self.dtype, self.device, cache_type)

    def head(self, x: torch.Tensor) -> torch.Tensor:
        """x [M, H] -> f32 logits [M, vocab_size]; columns past vocab_size (padded heads) are cut off."""
        if self.lm_head is None:
            logits = ops.dense_linear(x, self.embed, None)
        else:
            logits = self.lm_head(x)
        return logits[:, : self.vocab_size].float()

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, cache, meta: AttentionMetadata,
                logits: str = "last") -> torch.Tensor:
        """input_ids, positions int64 [B, Tq] -> f32 logits [B, V] ("last") or [B, Tq, V] ("all").

        Writes this step's K/V into `cache` at `meta.slots` before attending, so queries see themselves."""
        if logits not in ("last", "all"):
            raise ValueError(f"logits must be 'last' or 'all', got {logits!r}")
        b, tq = input_ids.shape
        h = ops.embedding(input_ids.reshape(-1), self.embed)  # [T, H]
        h, residual = self.run_layers(self.layers, h, None, positions.reshape(-1), self.inv_freq, cache, meta, b)
        return self.run_head(h, residual, b, tq, logits)

    def run_layers(self, layers, h: torch.Tensor, residual: torch.Tensor | None, positions: torch.Tensor,
                   inv_freq: torch.Tensor, cache, meta: AttentionMetadata, batch: int):
        """`layers` over h [T, H] -> (h, residual) [T, H]: the last MLP output and the residual stream before it.
        residual None: h is the embedding output (the first layer's norm has nothing to add). A layer split
        (model/split.py) runs each device's layers through this with that device's cache and metadata."""
        # Each norm runs inside the GEMV after it where the linear can (layers.norm_linear); from o_proj to the next
        # layer's q/k/v the GEMVs run as one persistent chain where they can (DecoderLayer.attention_out_mlp).
        if not layers:
            return h, residual
        # q/k/v GEMVs also run rope and the KV-cache write where they can (layers.norm_qkv)
        step = StepInputs(positions, inv_freq, cache, meta)
        qkv, residual, roped = norm_qkv(layers[0], h, residual, step)
        for i, layer in enumerate(layers):
            attn = layer.attend(qkv, positions, inv_freq, cache, meta, batch, roped=roped)
            nxt = layers[i + 1] if i + 1 < len(layers) else None
            out, residual, roped = layer.attention_out_mlp(attn, residual, nxt, step)
            if nxt is None:
                h = out
            else:
                qkv = out
        return h, residual

    def run_head(self, h: torch.Tensor, residual: torch.Tensor | None, b: int, tq: int, logits: str) -> torch.Tensor:
        """Final norm over h + residual [T, H], then the head: f32 logits [B, V] ("last") or [B, Tq, V] ("all")."""
        if residual is None:  # no layers: the stream is the embedding itself
            residual = h
        if logits == "last":
            h = h.reshape(b, tq, -1)[:, -1]  # [B, H]
            residual = residual.reshape(b, tq, -1)[:, -1]
        out = self.normed_head(h, residual)  # [B or T, V]
        return out if logits == "last" else out.reshape(b, tq, -1)

    def normed_head(self, h: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """head(rms_norm(h + residual)): f32 logits [M, V]; the norm inside the head's GEMV where it can run."""
        if self.lm_head is None:
            x, _ = ops.add_rms_norm(h, residual, self.norm, self.eps)
            return self.head(x)
        logits, _ = norm_linear(self.lm_head, h, residual, self.norm, self.eps)
        return logits[:, : self.vocab_size].float()

    __call__ = forward
