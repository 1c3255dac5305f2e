"""`TPLlamaModel`: one rank of a tensor-parallel Llama model (model/tp_shard.py says how weights are split).

Each rank holds the embedding, the norms and o_proj whole, its heads' q/k/v, its share of the MLP, its block
of the head, and a KV cache of its own KV heads (same page ids on every rank). The forward pass is
LlamaModel's: only two ops differ -- o_proj first gathers every rank's attention output (`GatherInput`), and
down_proj's partial sums are all-reduced (`ReduceOutput`) -- plus the head's all-gather of logits. Every
rank runs the same steps in the same order; rank 0 (the engine's process) drives the others
(runtime/tp_group.py) and only its logits are used.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from exl2_backend import ops
from exl2_backend.errors import ConfigError
from exl2_backend.model.layers import DecoderLayer, norm_linear
from exl2_backend.model.llama import LlamaModel
from exl2_backend.model.tp_shard import head_columns, shard_layer


class GatherInput:
    """A LinearOp whose input is split by columns over the ranks: all-gather it, then apply the whole op."""

    def __init__(self, op, comm):
        self.op, self.comm = op, comm

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.op(self.comm.all_gather_cols(x))  # [T, F / w] -> [T, F] -> [T, N]

    def __getattr__(self, name):
        return getattr(self.op, name)


class ReduceOutput:
    """A LinearOp holding a row slice: its partial output is summed over the ranks."""

    def __init__(self, op, comm):
        self.op, self.comm = op, comm

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.comm.all_reduce_(self.op(x).contiguous())

    def __getattr__(self, name):
        if name == "gated":  # the CUDA op's fused silu(gate) * up input (DecoderLayer.mlp), reduced as well
            gated = self.op.gated
            return lambda gate_up: self.comm.all_reduce_(gated(gate_up).contiguous())
        return getattr(self.op, name)


class _LocalHeads:
    """The model config with this rank's head counts (what DecoderLayer sizes its attention by)."""

    def __init__(self, config, world: int):
        self._config = config
        self.num_attention_heads = config.num_attention_heads // world
        self.num_key_value_heads = config.num_key_value_heads // world

    def __getattr__(self, name):
        return getattr(self._config, name)


def check_tensor_parallel(config, world: int) -> None:
    if world < 1 or config.num_key_value_heads % world or config.num_attention_heads % world:
        raise ConfigError(f"tensor_parallel={world} must divide the model's {config.num_attention_heads} attention "
                          f"heads and {config.num_key_value_heads} KV heads", field="tensor_parallel")


class TPLlamaModel(LlamaModel):
    """Rank `comm.rank` of `comm.world`. `weights` are the full model's (its `layers` may be a generator:
    each layer is sharded, prepared and dropped in turn)."""

    def __init__(self, config, weights, device, dtype: torch.dtype = torch.float16, *, comm):
        check_tensor_parallel(config, comm.world)
        super().__init__(config, replace(weights, layers=[], lm_head=None), device, dtype)
        self.comm, self.rank, self.world = comm, comm.rank, comm.world
        self.num_kv_heads = config.num_key_value_heads // comm.world  # this rank's cache
        local = _LocalHeads(config, comm.world)
        self.layers = []
        for i, lw in enumerate(weights.layers):
            layer = DecoderLayer(i, local, shard_layer(lw, config, comm.rank, comm.world), self.device, self.dtype)
            layer.o, layer.down = GatherInput(layer.o, comm), ReduceOutput(layer.down, comm)
            self.layers.append(layer)
        if weights.lm_head is not None:  # a tied head stays replicated (LlamaModel.head on the embedding)
            from exl2_backend.model.tp_shard import column_part

            cols = head_columns(config.vocab_size, comm.rank, comm.world)
            self.lm_head = ops.prepare_linear([column_part(weights.lm_head, cols)], self.device, self.dtype)
        self.coordinator = None  # rank 0: runtime/tp_group.Coordinator, which mirrors calls to the other ranks

    def head(self, x: torch.Tensor) -> torch.Tensor:
        if self.lm_head is None:
            return super().head(x)
        local = self.lm_head(x)  # [M, ceil(V / w)]
        return self.comm.all_gather_cols(local)[:, : self.vocab_size].float()  # [M, V]

    def normed_head(self, h: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        if self.lm_head is None:
            return super().normed_head(h, residual)
        local, _ = norm_linear(self.lm_head, h, residual, self.norm, self.eps)  # [M, ceil(V / w)]
        return self.comm.all_gather_cols(local)[:, : self.vocab_size].float()  # [M, V]

    # --- rank 0: the engine's calls reach every rank ----------------------------------------------------------

    def make_cache(self, num_pages: int, page_size: int, *args, **kwargs):
        cache = super().make_cache(num_pages, page_size, *args, **kwargs)
        if self.coordinator is None:
            return cache
        return self.coordinator.mirror_cache(cache, num_pages, page_size, args, kwargs)

    def make_runner(self, cache, max_pages: int, settings):
        from exl2_backend.runtime.tp_group import build_runner

        if self.coordinator is None:
            return build_runner(self, cache, max_pages, settings.max_batch_size, settings.use_cuda_graphs)
        return self.coordinator.mirror_runner(cache, max_pages, settings.max_batch_size, settings.use_cuda_graphs)

    def close(self) -> None:
        if self.coordinator is not None:
            self.coordinator.close()
            self.coordinator = None
