"""The model's vocabulary as llguidance reads it (token bytes, EOS ids), shared by grammars and logprobs."""

from __future__ import annotations

import torch

from exl2_backend.errors import InvalidRequestError
from exl2_backend.grammar.mask import mask_words, word_bit
from exl2_backend.grammar.matcher import SequenceGrammar
from exl2_backend.grammar.spec import compile_grammar


class Vocabulary:
    """The model's vocabulary as llguidance sees it: every token's bytes, the EOS ids, and `vocab_size` = the
    logits' width (token ids the tokenizer does not know, e.g. an embedding padded past it, are never allowed).
    Built once per engine (~0.3 s for 49k tokens): grammars' masks and the exact bytes of logprob tokens."""

    def __init__(self, tokenizer, vocab_size: int, eos_ids):
        import llguidance

        self.vocab_size = vocab_size
        backend = tokenizer.backend  # tokenizers.Tokenizer: llguidance reads its JSON form
        known = backend.get_vocab_size(with_added_tokens=True)
        n = max(vocab_size, known)
        # EOS ids the tokenizer does not know (a config's id in a padded embedding) are never allowed anyway;
        # llguidance refuses them
        eos = sorted(e for e in eos_ids if 0 <= e < known) or None
        self.llg = llguidance.LLTokenizer(backend.to_str(), n_vocab=n, eos_token=eos)
        self.words = mask_words(n)
        self._bytes: dict[int, bytes] = {}
        # tokens llguidance takes as special (the tokenizer's specials and every added <...> token) besides EOS:
        # a mask may offer one whose text a grammar forces although taking it fails (SequenceGrammar.fill_mask)
        self.special_words = torch.zeros(self.words, dtype=torch.int32)  # [W] their bits
        for i in (i for i in range(known) if self.llg.is_special_token(i) and i not in (eos or ())):
            self.special_words[i // 32] |= word_bit(i % 32)

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
