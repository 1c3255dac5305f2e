"""How tensor parallelism splits one decoder layer's weights over `world` ranks (rank r of them).

Attention: q/k/v by heads -- rank r gets KV heads [r Hkv/w, (r+1) Hkv/w) and the query heads that attend to
them (output columns, contiguous). o_proj is *not* split: each rank gathers every head's attention output
(one all-gather of [T, Hq D]) and applies the whole o_proj, so the residual stream stays replicated with no
reduction after attention.

Why not split o_proj by input rows like Megatron: EXL2 stores a linear's rows in activation order
(q_invperm), so the rows of one rank's heads are scattered over groups of different bit widths and scales,
and a row subset cannot be stored as whole 32-row groups without padding most of each group. Replicating
o_proj costs ~8% more weight reads per rank on a 70B shape and needs the same number of collectives (one per
attention block) as the Megatron split.

MLP: down_proj is split by *stored* rows into contiguous ranges of whole groups (rows balanced), which is
exact for any group layout; the input features of rank r's range are `q_perm[r0:r1]`, scattered. So rank r's
gate_proj/up_proj take exactly those output columns, in that order: its SiLU product is then the input of its
down_proj slice as is, with no permutation or gather at run time. Partial down outputs are summed by one
all-reduce; only rank 0 keeps a down bias. Head (untied): output columns split in equal blocks (the last
block padded by repeating the last column), logits all-gathered; a tied head stays replicated.

plan/vram.py's tensor-parallel sizes split LinearDescs the same way.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from exl2_backend.format.qtensor import QTensor, rows_in_input_order
from exl2_backend.format.qtensor_slice import balanced_group_ranges, select_columns, select_group_rows
from exl2_backend.format.reader import DenseLinear, LayerWeights


def column_part(lin, cols: torch.Tensor):
    """Output columns `cols` (int [n]) of a QTensor or DenseLinear."""
    if isinstance(lin, QTensor):
        return select_columns(lin, cols)
    c = cols.to(device=lin.weight.device, dtype=torch.long)
    bias = None if lin.bias is None else lin.bias.index_select(0, c.to(lin.bias.device))
    return DenseLinear(lin.key, lin.weight.index_select(0, c), bias)


def even_range(n: int, parts: int, rank: int) -> tuple[int, int]:
    """Rank's range of n items cut into `parts` near-equal contiguous pieces (plan/vram.py uses the same)."""
    step = -(-n // parts)
    return min(n, rank * step), min(n, (rank + 1) * step)


def row_part(lin, rank: int, world: int, keep_bias: bool):
    """-> (part, features int64 [rows]): rank's stored-row range of a QTensor (whole groups, balanced) or
    contiguous input range of a dense linear; part's local input j is original input features[j]."""
    if isinstance(lin, QTensor):
        g0, g1 = balanced_group_ranges(lin, world)[rank]
        part, features = select_group_rows(lin, g0, g1)
        return (part if keep_bias else replace(part, bias=None)), features
    r0, r1 = even_range(lin.in_features, world, rank)
    bias = lin.bias if keep_bias else None
    return DenseLinear(lin.key, lin.weight[:, r0:r1].contiguous(), bias), torch.arange(r0, r1)


def shard_layer(lw: LayerWeights, config, rank: int, world: int) -> LayerWeights:
    """Rank's part of one layer: q/k/v by heads, o_proj whole, gate/up columns matching down's row range."""
    d = config.head_dim
    hq, hkv = config.num_attention_heads // world, config.num_key_value_heads // world
    q_cols = torch.arange(rank * hq * d, (rank + 1) * hq * d)
    kv_cols = torch.arange(rank * hkv * d, (rank + 1) * hkv * d)
    down, features = row_part(lw.down_proj, rank, world, keep_bias=rank == 0)
    return LayerWeights(
        input_layernorm=lw.input_layernorm, post_attention_layernorm=lw.post_attention_layernorm,
        q_proj=column_part(lw.q_proj, q_cols), k_proj=column_part(lw.k_proj, kv_cols),
        v_proj=column_part(lw.v_proj, kv_cols), o_proj=lw.o_proj,
        gate_proj=column_part(lw.gate_proj, features), up_proj=column_part(lw.up_proj, features), down_proj=down)


def fold_down_order(lw: LayerWeights, device: torch.device | None = None) -> LayerWeights:
    """The MLP with down_proj's stored row order moved into gate/up's output columns (the one-rank case of
    shard_layer's MLP split): gate/up then produce the features in the order down_proj stores its rows, so down's
    input stage reads them contiguously instead of gathering every row through q_perm, and a verify step's down
    needs no pre-gather launch. Exact: every column keeps its own bit stream and scales, and down sums the same
    products in the same stored order. Unchanged when down_proj is dense or already unpermuted. `device`: gate/up
    QTensors are moved there first (the column gather of a memory-mapped 70B layer on the host costs ~0.1 s per
    matrix; the model packs them on that device next anyway)."""
    down = lw.down_proj
    if not isinstance(down, QTensor):
        return lw
    if rows_in_input_order(down.q_invperm):
        return lw
    part, features = row_part(down, 0, 1, keep_bias=True)

    def columns(lin):
        if device is not None and isinstance(lin, QTensor):
            lin = lin.to(device)
        return column_part(lin, features)

    return replace(lw, gate_proj=columns(lw.gate_proj), up_proj=columns(lw.up_proj), down_proj=part)


def head_columns(vocab: int, rank: int, world: int) -> torch.Tensor:
    """Rank's block of ceil(V / world) head columns; past the vocabulary the last column repeats (cut later)."""
    block = -(-vocab // world)
    return torch.arange(rank * block, (rank + 1) * block).clamp(max=vocab - 1)
