"""Batch sampling over per-sequence state: penalties from the sequences' counts, uniforms from their own
seeded generators (so a sequence's samples never depend on which others share its batch). On the GPU nothing
here waits for the device: host-built rows go through pinned memory, so the decode lookahead can queue a sampled
step behind the one in flight (runtime/lookahead.py); only sample_for's readback waits."""

from __future__ import annotations

import torch

from exl2_backend.grammar.mask import apply_grammar_masks, grammar_masks
from exl2_backend.ops.dispatch import apply_penalties, greedy_tokens, sample_tokens
from exl2_backend.ops.host_copy import staging, to_device, upload
from exl2_backend.ops.reference import make_uniforms
from exl2_backend.ops.reference_sampling import NAN_ROW


def penalized_logits(seqs, logits: torch.Tensor, pending: torch.Tensor | None = None) -> torch.Tensor:
    """logits [B, V] -> f32 [B, V] with each sequence's repetition/frequency/presence penalties applied from
    its prompt and output counts (objects with `params`, `prompt_counts`, `output_counts`, `logit_bias`,
    `grammar`, `banned`), then its logit bias added (`logit_bias`: ids and biases, or None), then its banned ids
    (EOS before min_new_tokens) and the tokens its grammar forbids set to -inf (`grammar`: a SequenceGrammar or
    None; a row it allows nothing in becomes NaN, which the samplers flag). The input is never written (it may be
    a graph's output). pending: int64 [B] on the logits' device, each row's token sampled but not yet appended
    (the decode lookahead's step in flight), counted as one more output token (-1, a NaN row's, counts nothing)
    by the penalties and by min_tokens' ban (`banned_after`)."""
    v, dev = logits.shape[1], logits.device
    logits = logits.float()
    if any(s.prompt_counts is not None for s in seqs):
        pc, oc = staging((len(seqs), v), torch.float32, dev), staging((len(seqs), v), torch.float32, dev)  # [B, V]
        for i, s in enumerate(seqs):
            if s.prompt_counts is not None:
                pc[i] = s.prompt_counts
            if s.output_counts is not None:
                oc[i] = s.output_counts
        oc = upload(oc, dev)
        if pending is not None:  # [B]: one more count at each row's token in flight
            oc[torch.arange(len(seqs), device=dev), pending.clamp_min(0)] += (pending >= 0).float()
        logits = apply_penalties(logits, upload(pc, dev), oc, [s.params.sampling for s in seqs])
    if any(s.logit_bias is not None for s in seqs):
        bias = staging(logits.shape, torch.float32, dev)  # [B, V], built on the host: one copy
        for i, s in enumerate(seqs):
            if s.logit_bias is not None:
                ids, values = s.logit_bias
                bias[i, ids] = values
        logits = logits + upload(bias, dev)
    banned = [s.banned for s in seqs] if pending is None else [s.banned_after(1) for s in seqs]
    if any(b is not None for b in banned):
        ban = staging(logits.shape, torch.bool, dev, False)  # [B, V] on the host: one copy
        for i, ids in enumerate(banned):
            if ids is not None:
                ban[i, [t for t in ids if t < v]] = True
        logits = logits.masked_fill(upload(ban, dev), float("-inf"))
    grammars = [s.grammar for s in seqs]
    constrained = [g for g in grammars if g is not None]
    if constrained:
        masks = grammar_masks(grammars, constrained[0].owner.words, pin=logits.is_cuda)  # [B, W] on the host
        logits = apply_grammar_masks(logits, masks)
    return logits


NAN_LOGITS = NAN_ROW  # the token greedy_tokens / sample_tokens give a row whose logits hold a NaN


def sample_on_device(seqs, logits: torch.Tensor, pending: torch.Tensor | None = None) -> torch.Tensor:
    """logits f32 [B, V] (one row per sequence, V = the model's vocab_size) -> int64 [B] on the logits' device:
    one token id per sequence, or NAN_LOGITS for a row with a NaN logit. Both samplers flag such a row themselves
    (the kernel while it reads the row). Nothing here waits for the GPU, so the decode lookahead queues its
    sampled steps through this very function: its tokens equal eager sampling's (`pending`: penalized_logits')."""
    v, dev = logits.shape[1], logits.device
    params = [s.params.sampling for s in seqs]
    logits = penalized_logits(seqs, logits, pending)
    # Greedy rows are the argmax (ties -> lowest id, as sample_tokens), drawing no uniforms so their
    # generators stay untouched; only the sampled rows go through the full sampler.
    tokens = greedy_tokens(logits)  # [B]
    rows = [i for i, p in enumerate(params) if p.temperature != 0]
    if rows:
        idx = to_device(rows, torch.int64, dev)  # [b']
        uniforms = upload(make_uniforms([seqs[i].generator for i in rows], v, pin=dev.type == "cuda"), dev)  # [b', V]
        picked = sample_tokens(logits.index_select(0, idx), [params[i] for i in rows], uniforms)
        tokens = tokens.index_copy(0, idx, picked)
    return tokens


def sample_for(seqs, logits: torch.Tensor) -> list[int]:
    """sample_on_device's tokens as a list: a sampler would otherwise quietly draw a token from a NaN row (the
    NaN's index, or token 0), a wrong answer nobody sees; NAN_LOGITS asks the caller to fail that sequence
    (tier 2). The check rides on the tokens' device-to-host copy."""
    return sample_on_device(seqs, logits).tolist()
