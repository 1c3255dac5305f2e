"""Reference of the captured greedy decode step's input kernel (csrc/layers/decode_io.cu): staging rows ->
the decode graph's static inputs."""

from __future__ import annotations

from typing import NamedTuple

import torch

from exl2_backend.errors import InvalidRequestError

STAGE_FIELDS = 4  # token | position | context length | cache slot, then the page ids
FROM_PREVIOUS = -1  # a staged token that means "the previous step's greedy token of this row"


class DecodeInputs(NamedTuple):
    ids: torch.Tensor  # int64 [B, 1]
    pos: torch.Tensor  # int64 [B, 1]
    lens: torch.Tensor  # int32 [B]
    slots: torch.Tensor  # int64 [B]
    tables: torch.Tensor  # int32 [B, W]


def decode_inputs(stage: torch.Tensor, prev: torch.Tensor | None = None) -> DecodeInputs:
    """stage int64 [B, 4 + W] (rows [token | position | context length | slot | W page ids]), prev int64 [B] or
    None -> the step's inputs. A row whose token is FROM_PREVIOUS takes prev[b] (and stays -1 without prev, which
    the embedding turns into a zero row)."""
    if stage.dtype != torch.int64 or stage.dim() != 2 or stage.shape[1] < STAGE_FIELDS:
        raise InvalidRequestError(f"decode_inputs: stage must be int64 [B, 4 + W], got {stage.dtype} "
                                  f"{tuple(stage.shape)}", field="stage")
    if prev is not None and (prev.dtype != torch.int64 or tuple(prev.shape) != (stage.shape[0],)):
        raise InvalidRequestError(f"decode_inputs: prev must be int64 [{stage.shape[0]}], got {prev.dtype} "
                                  f"{tuple(prev.shape)}", field="prev")
    tokens = stage[:, 0]
    if prev is not None:
        tokens = torch.where(tokens == FROM_PREVIOUS, prev.to(stage.device), tokens)
    return DecodeInputs(tokens.unsqueeze(1).clone(), stage[:, 1:2].clone(), stage[:, 2].to(torch.int32),
                        stage[:, 3].clone(), stage[:, STAGE_FIELDS:].to(torch.int32))
