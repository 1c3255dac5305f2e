"""Batch sampling over per-sequence state: penalties from the sequences' counts, uniforms from their own
seeded generators (so a sequence's samples never depend on which others share its batch)."""

from __future__ import annotations

import torch

from exl2_backend.grammar.mask import apply_grammar_masks, grammar_masks
from exl2_backend.ops.dispatch import greedy_tokens
from exl2_backend.ops.reference import apply_penalties, make_uniforms, sample_tokens
from exl2_backend.ops.reference_sampling import NAN_ROW


def penalized_logits(seqs, logits: torch.Tensor) -> torch.Tensor:
    """logits [B, V] -> f32 [B, V] with each sequence's repetition/frequency/presence penalties applied from
    its prompt and output counts (objects with `params`, `prompt_counts`, `output_counts`, `logit_bias`,
    `grammar`, `banned`), then its logit bias added (`logit_bias`: ids and biases, or None), then its banned ids
    (EOS before min_new_tokens) and the tokens its grammar forbids set to -inf (`grammar`: a SequenceGrammar or
    None; a row it allows nothing in becomes NaN, which the samplers flag). The input is never written (it may be
    a graph's output)."""
    v = logits.shape[1]
    logits = logits.float()
    if any(s.prompt_counts is not None for s in seqs):
        zeros = torch.zeros(v)
        pc = torch.stack([zeros if s.prompt_counts is None else s.prompt_counts for s in seqs])  # [B, V]
        oc = torch.stack([zeros if s.output_counts is None else s.output_counts for s in seqs])
        logits = apply_penalties(logits, pc.to(logits.device), oc.to(logits.device), [s.params.sampling for s in seqs])
    if any(s.logit_bias is not None for s in seqs):
        bias = torch.zeros(logits.shape, dtype=torch.float32)  # [B, V], built on the host: one copy
        for i, s in enumerate(seqs):
            if s.logit_bias is not None:
                ids, values = s.logit_bias
                bias[i, ids] = values
        logits = logits + bias.to(logits.device, non_blocking=True)
    banned = [s.banned for s in seqs]
    if any(b is not None for b in banned):
        ban = torch.zeros(logits.shape, dtype=torch.bool)  # [B, V] on the host: one copy
        for i, ids in enumerate(banned):
            if ids is not None:
                ban[i, [t for t in ids if t < v]] = True
        logits = logits.masked_fill(ban.to(logits.device, non_blocking=True), float("-inf"))
    grammars = [s.grammar for s in seqs]
    constrained = [g for g in grammars if g is not None]
    if constrained:
        masks = grammar_masks(grammars, constrained[0].owner.words, pin=logits.is_cuda)  # [B, W] on the host
        logits = apply_grammar_masks(logits, masks)
    return logits


NAN_LOGITS = NAN_ROW  # the token greedy_tokens / sample_tokens give a row whose logits hold a NaN


def sample_for(seqs, logits: torch.Tensor) -> list[int]:
    """logits f32 [B, V] (one row per sequence, V = the model's vocab_size) -> one token id per sequence, or
    NAN_LOGITS for a row with a NaN logit: a numerical fault the caller fails that sequence for (tier 2). A
    sampler would otherwise quietly draw a token from such a row (the NaN's index, or token 0), a wrong answer
    nobody sees. Both samplers flag the row themselves (the kernel while it reads the row), so the check rides on
    the tokens' device-to-host copy."""
    v = logits.shape[1]
    params = [s.params.sampling for s in seqs]
    logits = penalized_logits(seqs, logits)
    # Greedy rows are the argmax (ties -> lowest id, as sample_tokens), drawing no uniforms so their
    # generators stay untouched; only the sampled rows go through the full sampler.
    tokens = greedy_tokens(logits)  # [B]
    rows = [i for i, p in enumerate(params) if p.temperature != 0]
    if rows:
        uniforms = make_uniforms([seqs[i].generator for i in rows], v).to(logits.device)  # [b', V]
        tokens[rows] = sample_tokens(logits[rows], [params[i] for i in rows], uniforms)
    return tokens.tolist()
