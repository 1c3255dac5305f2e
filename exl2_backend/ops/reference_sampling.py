"""Reference sampler: penalties, temperature, top-k, top-p, min-p and an exponential race over per-sequence
uniforms. The GPU sampler must reproduce `sample_tokens` given the same uniforms.

Pipeline per row (after `apply_penalties`): temperature 0 -> argmax (ties -> lowest id). Otherwise
p = softmax(logits / T); sort by p descending (stable: equal p -> lower id first); keep the first top_k
(0 = all); renormalize; keep the smallest prefix whose cumulative p reaches top_p (the top token always
stays; top_p >= 1 keeps all); renormalize; drop p < min_p * p_max; renormalize. Then
token = argmax_i p_i / E_i with E_i = max(-log(u_i), 2^-25) and u in (0, 1]: the E_i are i.i.d. Exp(1)
(up to fp32 resolution), and the argmax of p_i / E_i is an exact draw from p (ties -> lowest id; tokens
with p = 0 never win). All in fp32.
"""

from __future__ import annotations

import random

import torch

_MIN_EXP = 2.0**-25  # floor of -log(u) in the race (see sample_tokens)


def apply_penalties(logits, prompt_counts, output_counts, params) -> torch.Tensor:
    """logits [B, V] f32, prompt_counts/output_counts [B, V] (token occurrence counts) -> new [B, V] f32.

    repetition_penalty rp over tokens seen in prompt or output: logit > 0 -> logit / rp, else logit * rp.
    frequency/presence (OpenAI): logit -= freq * out_count + presence * (out_count > 0), output tokens only."""
    dev = logits.device
    rp = torch.tensor([p.repetition_penalty for p in params], dtype=torch.float32, device=dev)[:, None]  # [B, 1]
    fp = torch.tensor([p.frequency_penalty for p in params], dtype=torch.float32, device=dev)[:, None]
    pp = torch.tensor([p.presence_penalty for p in params], dtype=torch.float32, device=dev)[:, None]
    out = logits.float().clone()
    oc = output_counts.to(device=dev, dtype=torch.float32)
    seen = (prompt_counts.to(dev) > 0) | (oc > 0)  # [B, V]
    penalized = torch.where(out > 0, out / rp, out * rp)
    out = torch.where(seen & (rp != 1.0), penalized, out)
    return out - (fp * oc + pp * (oc > 0).float())


def active_filters(params, vocab: int) -> frozenset:
    """The filters (top_k, top_p, min_p) some sampled row of the batch uses (host-side parameters). A filter no
    sampled row uses leaves every row as it is, so both samplers skip it (and the reference its sort when none is
    on): the same bits. Greedy rows' filters do not count: their distribution is the argmax's one-hot."""
    sampled = [p for p in params if p.temperature != 0]
    return frozenset(name for name, on in (("top_k", any(0 < p.top_k < vocab for p in sampled)),
                                           ("top_p", any(p.top_p < 1.0 for p in sampled)),
                                           ("min_p", any(p.min_p > 0.0 for p in sampled))) if on)


def top_k_bound(params, vocab: int) -> int | None:
    """The largest top_k of the batch's sampled rows when every one of them keeps fewer than `vocab` tokens, else
    None. Top-k then zeroes every rank from there on in each sampled row (greedy rows end as their argmax's
    one-hot), so the sort may stop at that rank (descending_sort's `bound`) and leave the same bits."""
    ks = [p.top_k for p in params if p.temperature != 0]
    return max(ks) if ks and all(0 < k < vocab for k in ks) else None


def descending_sort(probs: torch.Tensor, bound: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """probs [B, V] f32 >= 0 -> (sp [B, V], idx [B, V] or [B, bound]): the stable descending sort (equal p -> lower
    id first). With `bound`, on the CPU, only its first `bound` ranks, sp zero past them: one top-k over distinct
    64-bit keys (p's bits, monotone for p >= 0, above the reversed id), so no two keys tie and top-k's descending
    order is the stable sort's. On the CPU that is 6-13x cheaper than the sort (49k / 128k vocabularies: 1.1 /
    2.1 ms against 5.0 / 13.5 for top-k 50 + top-p); on the GPU the sort stays: one 128k row's top-k is slower
    there (H100, scripts/filter_cost.py, 2026-12-05: sort 91 us, this bounded sort 298, fp32 top-k 113)."""
    b_, v = probs.shape
    if bound is None or bound >= v or probs.device.type != "cpu":
        return torch.sort(probs, dim=-1, descending=True, stable=True)
    reversed_ids = torch.arange(v - 1, -1, -1, device=probs.device)  # [V]: a lower id is the larger key
    keys = (probs.contiguous().view(torch.int32).to(torch.int64) << 32) | reversed_ids  # [B, V] distinct
    idx = (v - 1) - (torch.topk(keys, bound, dim=-1).values & 0xFFFFFFFF)  # [B, bound] ids by rank
    sp = probs.new_zeros(b_, v)
    sp[:, :bound] = probs.gather(-1, idx)
    return sp, idx


def sampling_probs(logits, params) -> torch.Tensor:
    """logits [B, V] f32 (penalties applied) -> f32 [B, V], the exact distribution `sample_tokens` draws from
    (a one-hot at the argmax for greedy rows). A filter that is off leaves its row untouched (no renorm)."""
    b_, v = logits.shape
    dev = logits.device

    def col(values, dtype=torch.float32):  # per-row parameter as [B, 1]
        return torch.tensor(values, dtype=dtype, device=dev)[:, None]

    temp = col([p.temperature for p in params])
    top_k = col([p.top_k if 0 < p.top_k < v else v for p in params], torch.long)
    top_p = col([p.top_p for p in params])
    min_p = col([p.min_p for p in params])
    greedy = temp == 0  # [B, 1]

    probs = torch.softmax(logits.float() / torch.where(greedy, 1.0, temp), dim=-1)  # [B, V]
    on = active_filters(params, v)  # the others leave every row as it is
    out = probs
    if on:
        sp, idx = descending_sort(probs, top_k_bound(params, v))  # equal p -> lower id first

        def keep(mask, active):  # zero the dropped tokens and renormalize, only on rows where the filter is on
            kept = torch.where(mask, sp, 0.0)
            return torch.where(active, kept / kept.sum(-1, keepdim=True), sp)

        if "top_k" in on:
            sp = keep(torch.arange(v, device=dev)[None, :] < top_k, top_k < v)  # rank < k
        if "top_p" in on:
            # mass ranked strictly above each token; it is 0 < top_p for the top token, which therefore always stays
            before = torch.cat((sp.new_zeros(b_, 1), torch.cumsum(sp, -1)[:, :-1]), dim=-1)
            sp = keep(before < top_p, top_p < 1.0)
        if "min_p" in on:
            sp = keep(sp >= min_p * sp[:, :1], min_p > 0.0)
        out = torch.zeros_like(sp).scatter_(-1, idx, sp[:, :idx.shape[1]])  # past a bound sp is zero
    one_hot = torch.zeros_like(out).scatter_(-1, torch.argmax(logits.float(), -1, keepdim=True), 1.0)
    return torch.where(greedy, one_hot, out)


def sample_tokens(logits, params, uniforms=None) -> torch.Tensor:
    """logits [B, V] f32, params list[SamplingParams], uniforms [B, V] f32 in (0, 1] (None: drawn from the
    global torch RNG) -> int64 [B], NAN_ROW for a row holding a NaN or +inf."""
    b_, v = logits.shape
    probs = sampling_probs(logits, params)  # [B, V]
    if uniforms is None:
        uniforms = 1.0 - torch.rand(b_, v, dtype=torch.float32, device=logits.device)
    expo = -torch.log(uniforms.to(device=logits.device, dtype=torch.float32))  # [B, V] Exp(1) draws
    # u = 1 (probability 2^-24 per element on torch's grid) gives -0.0; it stands for E in [0, 2^-24), so
    # use 2^-25, below every other value: a plausible token still wins, a negligible one does not.
    race = probs / expo.clamp_min(_MIN_EXP)
    race = torch.where(probs > 0, race, race.new_full((), -1.0))  # p = 0 never wins
    tokens = torch.argmax(race, dim=-1).to(torch.int64)  # greedy rows are one-hot, so they pick their argmax
    return _nan_rows_flagged(logits, tokens)


NAN_ROW = -1  # the token of a row whose logits hold a NaN or +inf: a numerical fault, never a token to emit


def faulty_rows(logits: torch.Tensor) -> torch.Tensor:
    """logits [B, V] -> bool [B]: rows holding a NaN or +inf (an fp16 overflow). Sampling from one would quietly
    give the NaN's index, the +inf's, or token 0 from a NaN softmax; the engine fails such a sequence instead.
    -inf is a legitimate logit (a masked token)."""
    return (torch.isnan(logits) | torch.isposinf(logits)).any(-1)


def _nan_rows_flagged(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """tokens int64 [B] with NAN_ROW where the row of logits [B, V] is faulty (faulty_rows)."""
    return torch.where(faulty_rows(logits), NAN_ROW, tokens)


def make_generator(seed: int | None, device="cpu") -> torch.Generator:
    """A per-sequence generator: seeded from `seed`, or from fresh entropy when None."""
    g = torch.Generator(device=device)
    g.manual_seed(seed if seed is not None else random.SystemRandom().getrandbits(63))
    return g


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    """logits [B, V] -> int64 [B]: each row's argmax, ties to the lowest id; NAN_ROW for a row holding a NaN or
    +inf."""
    logits = logits.float()
    return _nan_rows_flagged(logits, torch.argmax(logits, dim=-1))


def make_uniforms(generators: list[torch.Generator], vocab: int, pin: bool = False) -> torch.Tensor:
    """One row of `vocab` uniforms in (0, 1] per generator (advancing it) -> f32 [B, V] on the generators'
    device (a GPU generator's: one kernel a row; CPU generators' in pinned memory when `pin`, for a copy to the
    GPU that does not wait for it).
    1 - rand maps torch's [0, 1) grid exactly onto (0, 1]; -u + 1 is the same IEEE operation."""
    device = generators[0].device if generators else torch.device("cpu")
    out = torch.empty((len(generators), vocab), dtype=torch.float32, device=device,
                      pin_memory=pin and device.type == "cpu")  # [B, V]
    for row, g in zip(out, generators):
        torch.rand(vocab, generator=g, out=row)
    return out.neg_().add_(1.0)
