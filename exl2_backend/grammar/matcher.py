"""Per-sequence grammar state on llguidance: which tokens may come next (a bitmask over the vocabulary), and the
tokens taken so far.

The engine builds one `Vocabulary` per model (grammar/vocabulary.py) and one `SequenceGrammar` per constrained
sequence. Masks are computed on the host for the rows that sample
(llguidance: tens of us to a few ms per token); such sequences sample eagerly, never in the greedy lookahead."""

from __future__ import annotations

import torch

from exl2_backend.errors import InvalidRequestError
from exl2_backend.grammar.mask import allows_nothing, word_bit


class SequenceGrammar:
    """One sequence's place in its grammar."""

    def __init__(self, owner, text: str | None = None, *, matcher=None):  # owner: grammar/vocabulary.Vocabulary
        import llguidance

        self.owner = owner
        self._m = matcher if matcher is not None else llguidance.LLMatcher(owner.llg, text, log_level=0)
        if self._m.is_error():
            raise InvalidRequestError(f"the grammar does not compile: {self._m.get_error()}", field="grammar")

    def fork(self) -> SequenceGrammar:
        """An independent copy (a draft model proposes on its own copy, ahead of the sequence)."""
        return SequenceGrammar(self.owner, matcher=self._m.deep_copy())

    def fill_mask(self, row: torch.Tensor) -> None:
        """Write the tokens allowed next into `row` (int32 [words] on the CPU, contiguous). An error state or a
        grammar that admits nothing more writes all zeros: nothing may be sampled."""
        assert row.dtype == torch.int32 and row.device.type == "cpu" and row.is_contiguous()
        self._m.unsafe_compute_mask_ptr(row.data_ptr(), row.numel() * 4)
        self._drop_untakeable_specials(row)

    def _drop_untakeable_specials(self, row: torch.Tensor) -> None:
        """Clear the bits of special tokens the grammar would not take. llguidance's mask can offer an added token
        whose text the grammar forces (Qwen2.5's <tool_call> where a grammar spells "<tool_call>") although
        consuming it fails; sampled, it would fail the sequence. Rare bits, checked one by one."""
        hits = row & self.owner.special_words  # [W]
        if not bool(hits.any()):
            return
        for word in hits.nonzero().flatten().tolist():
            bits = int(hits[word]) & 0xFFFFFFFF
            while bits:
                b = (bits & -bits).bit_length() - 1
                bits &= bits - 1
                if self._m.validate_tokens([word * 32 + b]) != 1:
                    row[word] &= ~word_bit(b)

    def allows_nothing(self) -> bool:
        """Whether no token of the model may come next (an error state, a complete grammar without an EOS token,
        or only tokenizer ids past the model's vocabulary)."""
        row = torch.empty(1, self.owner.words, dtype=torch.int32)
        self.fill_mask(row[0])
        return bool(allows_nothing(row, self.owner.vocab_size)[0])

    def valid_prefix(self, tokens: list[int]) -> int:
        """How many of `tokens` the grammar would take from here, without taking them (a filter for drafts; the
        masks may still refuse a non-canonical spelling among them)."""
        return self._m.validate_tokens(list(tokens))

    def consume(self, token: int) -> bool:
        """Take a sampled token; False when the grammar does not allow it (then the state is an error)."""
        return self._m.consume_token(token)

    def rollback(self, num_tokens: int) -> None:
        self._m.rollback(num_tokens)

    @property
    def stopped(self) -> bool:
        """The grammar is complete and allows nothing more (EOS aside): the output is finished."""
        return self._m.is_stopped()

    @property
    def error(self) -> str:
        """llguidance's message when the state is an error (a token it did not allow), else ""."""
        return self._m.get_error() if self._m.is_error() else ""
