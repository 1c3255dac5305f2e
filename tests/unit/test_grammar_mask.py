"""Grammar masks on logits (exl2_backend/grammar/mask.py) against a per-token loop: odd vocabulary sizes (not a
multiple of 32, a last word only partly used), rows without a grammar untouched, a row allowing nothing turned NaN
(which both samplers flag). Exact: masking only selects values."""

from __future__ import annotations

import pytest
import torch

from exl2_backend.grammar.mask import apply_grammar_masks, grammar_masks, mask_words
from exl2_backend.ops.reference import sample_tokens
from exl2_backend.ops.reference_sampling import NAN_ROW
from exl2_backend.sampling import SamplingParams


class _FixedGrammar:
    """Stands in for a SequenceGrammar: a fixed allowed set (what fill_mask writes is all the mask code reads)."""

    def __init__(self, allowed: set[int]):
        self.allowed = allowed

    def fill_mask(self, row: torch.Tensor) -> None:
        words = [0] * row.numel()
        for t in self.allowed:
            words[t // 32] |= 1 << (t % 32)
        row.copy_(torch.tensor([w - (1 << 32) if w >= 1 << 31 else w for w in words], dtype=torch.int32))


def _reference(logits: torch.Tensor, grammars: list) -> torch.Tensor:
    out = logits.clone()
    for i, g in enumerate(grammars):
        if g is None:
            continue
        if not g.allowed:
            out[i] = float("nan")
            continue
        for t in range(logits.shape[1]):
            if t not in g.allowed:
                out[i, t] = float("-inf")
    return out


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
@pytest.mark.parametrize("vocab", [1, 31, 32, 33, 95, 4096, 5001])
def test_masks_match_a_per_token_loop(vocab, device):
    g = torch.Generator().manual_seed(vocab)
    logits = torch.randn(5, vocab, generator=g)  # [B, V]
    picks = [set(torch.randint(0, vocab, (max(1, vocab // 7),), generator=g).tolist()) for _ in range(3)]
    grammars = [_FixedGrammar(picks[0]), None, _FixedGrammar(picks[1] | {vocab - 1}), _FixedGrammar({0}),
                _FixedGrammar(picks[2])]
    masks = grammar_masks(grammars, mask_words(vocab), pin=device == "cuda")  # [B, W]
    got = apply_grammar_masks(logits.to(device), masks).cpu()
    want = _reference(logits, grammars)
    assert torch.equal(got.isnan(), want.isnan())
    assert torch.equal(got.nan_to_num(nan=7.0), want.nan_to_num(nan=7.0))
    assert torch.equal(got[1], logits[1])  # no grammar: untouched


def test_a_row_allowing_nothing_is_flagged_by_the_samplers():
    logits = torch.randn(2, 40)
    masks = grammar_masks([_FixedGrammar(set()), _FixedGrammar({3, 39})], mask_words(40), pin=False)
    masked = apply_grammar_masks(logits, masks)
    greedy = sample_tokens(masked, [SamplingParams.greedy()] * 2, torch.rand(2, 40))
    sampled = sample_tokens(masked, [SamplingParams(temperature=1.0)] * 2, torch.rand(2, 40))
    assert greedy[0] == sampled[0] == NAN_ROW
    assert greedy[1] in (3, 39) and sampled[1] in (3, 39)
    assert int(logits[1, [3, 39]].argmax()) == [3, 39].index(int(greedy[1]))


def test_allowed_ids_past_the_logits_width_do_not_count():
    """A tokenizer may know ids the embedding lacks: a mask that allows only those allows nothing here (NaN row),
    never an all -inf row from which greedy would take token 0."""
    logits = torch.randn(2, 40)
    masks = grammar_masks([_FixedGrammar({45}), _FixedGrammar({45, 39})], mask_words(64), pin=False)
    masked = apply_grammar_masks(logits, masks)
    assert masked[0].isnan().all() and masked[1, 39] == logits[1, 39] and masked[1, :39].isinf().all()


def test_rejection_sampling_refuses_a_row_its_grammar_empties():
    """A sampled draft checked against a target row whose grammar allows nothing: NAN_ROW (the sequence fails), not
    a race over a NaN distribution that quietly gives token 0."""
    from types import SimpleNamespace

    from exl2_backend.runtime.params import GenerationParams
    from exl2_backend.spec.rejection import accept_or_resample

    def seq(allowed):
        grammar = _FixedGrammar(allowed)
        grammar.owner = SimpleNamespace(words=mask_words(50))
        return SimpleNamespace(params=GenerationParams(sampling=SamplingParams(temperature=1.0)), prompt_counts=None,
                               output_counts=None, logit_bias=None, grammar=grammar, banned=None,
                               generator=torch.Generator().manual_seed(0))

    logits, q = torch.randn(1, 50), torch.full((50,), 1 / 50)
    assert accept_or_resample(seq(set()), logits, 3, q) == NAN_ROW
    assert accept_or_resample(seq({7, 9}), logits, 3, q) in (7, 9)  # the draft (3) is outside: resampled inside
