"""Per-sequence grammar state on llguidance: which tokens may come next (a bitmask over the vocabulary), and the
tokens taken so far.

The engine builds one `GrammarTokenizer` per model (the vocabulary's token bytes, ~0.2 s for 49k tokens) and
one `SequenceGrammar` per constrained sequence. Masks are computed on the host for the rows that sample
(llguidance: tens of us to a few ms per token); such sequences sample eagerly, never in the greedy lookahead."""

from __future__ import annotations

import torch

from exl2_backend.errors import InvalidRequestError
from exl2_backend.grammar.mask import allows_nothing, mask_words
from exl2_backend.grammar.spec import compile_grammar


class GrammarTokenizer:
    """The model's vocabulary as llguidance sees it: every token's bytes, the EOS ids, and `vocab_size` = the
    logits' width (token ids the tokenizer does not know, e.g. an embedding padded past it, are never allowed)."""

    def __init__(self, tokenizer, vocab_size: int, eos_ids):
        import llguidance

        self.vocab_size = vocab_size
        backend = tokenizer.backend  # tokenizers.Tokenizer: llguidance reads its JSON form
        n = max(vocab_size, backend.get_vocab_size(with_added_tokens=True))
        eos = sorted(eos_ids) or None
        self.llg = llguidance.LLTokenizer(backend.to_str(), n_vocab=n, eos_token=eos)
        self.words = mask_words(n)
        self._bytes: dict[int, bytes] = {}

    def token_bytes(self, token_id: int) -> bytes:
        """The token's own bytes (a byte-level token may hold part of a UTF-8 character; a special token gives
        its text); b"" for an id the tokenizer does not know."""
        out = self._bytes.get(token_id)
        if out is None:
            known = 0 <= token_id < self.llg.vocab_size
            out = self._bytes[token_id] = self.llg.decode_bytes([token_id]) if known else b""
        return out

    def matcher(self, grammar: dict) -> SequenceGrammar:
        """A fresh state of `grammar` (a well-formed spec dict); InvalidRequestError(field="grammar") naming what
        does not compile."""
        text, message = compile_grammar(grammar, self.llg)
        if text is None:
            raise InvalidRequestError(f"the {grammar['type']} grammar does not compile: {message}", field="grammar")
        return SequenceGrammar(self, text)


class SequenceGrammar:
    """One sequence's place in its grammar."""

    def __init__(self, owner: GrammarTokenizer, text: str | None = None, *, matcher=None):
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

    def allows_nothing(self) -> bool:
        """Whether no token of the model may come next (an error state, a complete grammar without an EOS token,
        or only tokenizer ids past the model's vocabulary)."""
        row = torch.empty(1, self.owner.words, dtype=torch.int32)
        self.fill_mask(row[0])
        return bool(allows_nothing(row, self.owner.vocab_size)[0])

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
