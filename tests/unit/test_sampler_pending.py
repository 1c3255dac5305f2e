"""runtime/sampler.py's `pending` tokens (the decode lookahead's step in flight, not yet appended on the host): the
penalties and min_tokens' ban see them exactly as if appended, a -1 (a NaN row's) counts nothing, and rows without
penalties are untouched; sample_on_device gives the tokens sample_for lists."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from exl2_backend.runtime.sampler import penalized_logits, sample_for, sample_on_device
from exl2_backend.sampling import SamplingParams

V = 50


def _seq(sampling: SamplingParams, prompt: list[int], out: list[int], seed: int = 0):
    pc = oc = None
    if sampling.repetition_penalty != 1.0 or sampling.frequency_penalty or sampling.presence_penalty:
        pc = torch.bincount(torch.tensor(prompt), minlength=V).float()
        oc = torch.bincount(torch.tensor(out, dtype=torch.long), minlength=V).float()
    return SimpleNamespace(params=SimpleNamespace(sampling=sampling), prompt_counts=pc, output_counts=oc,
                           logit_bias=None, grammar=None, banned=None, banned_after=lambda n: None,
                           generator=torch.Generator().manual_seed(seed))


def test_pending_tokens_count_as_appended():
    pen = SamplingParams(temperature=0.7, repetition_penalty=1.3, frequency_penalty=0.4, presence_penalty=0.2)
    logits = torch.randn(3, V, generator=torch.Generator().manual_seed(0))
    before = [_seq(pen, [1, 2, 3], [4, 5]), _seq(SamplingParams.greedy(), [6], []), _seq(pen, [7], [7, 8])]
    pending = torch.tensor([9, 11, -1])
    after = [_seq(pen, [1, 2, 3], [4, 5, 9]), _seq(SamplingParams.greedy(), [6], []), _seq(pen, [7], [7, 8])]
    got = penalized_logits(before, logits, pending)
    assert torch.equal(got, penalized_logits(after, logits))
    assert torch.equal(got[1], logits[1])  # no penalties: untouched
    assert torch.equal(penalized_logits(before, logits), penalized_logits(before, logits, None))
    assert before[0].output_counts[9] == 0  # the host's counts are not written


def test_sample_on_device_lists_as_sample_for():
    params = [SamplingParams(temperature=0.9, top_p=0.8), SamplingParams.greedy(), SamplingParams(temperature=1.2)]
    logits = torch.randn(3, V, generator=torch.Generator().manual_seed(1))
    a = sample_on_device([_seq(p, [1], [], seed=i) for i, p in enumerate(params)], logits)
    b = sample_for([_seq(p, [1], [], seed=i) for i, p in enumerate(params)], logits)
    assert a.dtype == torch.int64 and a.tolist() == b
    assert b[1] == int(torch.argmax(logits[1]))


def test_min_tokens_ban_counts_the_pending_token():
    """A real Sequence with min_new_tokens=3: with one token out and one in flight EOS is still banned, with two out
    and one in flight it no longer is (banned_after)."""
    from exl2_backend.runtime import GenerationParams
    from exl2_backend.runtime.sequence import Sequence

    params = GenerationParams(sampling=SamplingParams(temperature=0.9), max_new_tokens=10, min_new_tokens=3)
    seq = Sequence("s", [1, 2], params, max_total=12, vocab_size=V, eos_ids={0}, decoder=None, stop_matcher=None)
    logits = torch.zeros(1, V)
    seq.output_ids = [5]
    assert seq.banned == [0] and seq.banned_after(1) == [0]
    assert penalized_logits([seq], logits, torch.tensor([6]))[0, 0] == float("-inf")
    seq.output_ids = [5, 6]
    assert seq.banned == [0] and seq.banned_after(1) is None
    assert torch.equal(penalized_logits([seq], logits, torch.tensor([7])), logits)
