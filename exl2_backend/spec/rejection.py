"""Speculative sampling that keeps the target's distribution (rejection sampling over the draft's).

A draft token d was drawn from the draft's distribution q. The target accepts it with probability
min(1, p(d) / q(d)); on rejection it draws from the residual max(p - q, 0) (renormalized). The emitted token is
then distributed exactly as p, whatever q is. p and q are the *processed* distributions each side samples
from (penalties, temperature, top-k, top-p, min-p: `sampling_probs`), so sampling settings are honoured.

A deterministic proposal (n-gram, greedy draft) has q = one-hot(d); the rule then reduces to "sample from p,
accept if it equals d", which is what `Engine._accept` does when it has no q (and it then draws the same
uniforms as plain decoding, so seeded output is identical). Greedy sequences never reach this module.
"""

from __future__ import annotations

import torch

from exl2_backend.ops.reference import make_uniforms, sampling_probs
from exl2_backend.ops.reference_sampling import NAN_ROW, faulty_rows
from exl2_backend.runtime.sampler import penalized_logits

_MIN_EXP = 2.0**-25  # the reference sampler's floor of -log(u) (ops/reference_sampling.py)


def processed_probs(seqs, logits: torch.Tensor) -> torch.Tensor:
    """logits [B, V] -> f32 [B, V]: the distribution each sequence's sampler draws from (penalties included)."""
    return sampling_probs(penalized_logits(seqs, logits), [s.params.sampling for s in seqs])


def race(probs: torch.Tensor, generators: list[torch.Generator]) -> torch.Tensor:
    """One exact draw per row of (unnormalized) probs [B, V] with uniforms from each row's generator -> int64 [B]:
    argmax p_i / E_i with E_i ~ Exp(1), the reference sampler's race."""
    uniforms = make_uniforms(generators, probs.shape[1]).to(probs.device)  # [B, V]
    expo = (-torch.log(uniforms)).clamp_min(_MIN_EXP)
    score = torch.where(probs > 0, probs / expo, probs.new_full((), -1.0))
    return torch.argmax(score, dim=-1)


def accept_or_resample(seq, logits: torch.Tensor, draft_token: int, q: torch.Tensor) -> int:
    """logits [1, V] of the target at the draft's position, q [V] the distribution `draft_token` was drawn
    from -> the token to emit (== draft_token when accepted), or NAN_ROW where the logits, penalized and masked
    by the sequence's grammar, are faulty (NaN or +inf, or a grammar that allows nothing: the caller fails the
    sequence; the race would quietly give token 0). Uses seq.generator (reproducible per seed)."""
    shaped = penalized_logits([seq], logits)  # [1, V]
    if bool(faulty_rows(shaped).any()):
        return NAN_ROW
    p = sampling_probs(shaped, [seq.params.sampling])[0]  # [V]
    q = q.to(device=p.device, dtype=torch.float32)
    pd, qd = float(p[draft_token]), float(q[draft_token])
    if qd <= 0.0:  # not a draw from q (our drafters never do this): treat it as a deterministic proposal
        return int(race(p[None, :], [seq.generator])[0])
    u = 1.0 - float(torch.rand(1, generator=seq.generator, device=seq.generator.device))  # (0, 1]
    if u * qd <= pd:  # accept with probability min(1, p(d) / q(d))
        return int(draft_token)
    residual = (p - q).clamp_min(0.0)  # [V]; residual[d] = 0 after a rejection
    if not bool((residual > 0).any()):  # p == q up to rounding: the residual is empty, p itself is the answer
        residual = p
    return int(race(residual[None, :], [seq.generator])[0])
