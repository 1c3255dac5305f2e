"""Draft/target vocabulary compatibility: a draft token id must mean the same token to the target."""

from __future__ import annotations

from exl2_backend.errors import VocabMismatchError


def _id_to_token(tokenizer) -> dict[int, str]:
    return {i: t for t, i in tokenizer.backend.get_vocab(with_added_tokens=True).items()}


def check_vocab_compatible(target_config, target_tokenizer, draft_config, draft_tokenizer, draft_dir) -> None:
    """Raise VocabMismatchError unless every token id both tokenizers define is the same token (padded heads
    may differ in size: the draft never proposes ids the target lacks). Without both tokenizers, the model
    vocab sizes must be equal."""
    tv, dv = int(target_config.vocab_size), int(draft_config.vocab_size)
    hint = "use a draft model from the same family (same tokenizer) as the target"
    if target_tokenizer is None or draft_tokenizer is None:
        if tv != dv:
            raise VocabMismatchError(f"draft model {draft_dir} has vocab_size {dv} but the target has {tv}; {hint}",
                                     field="draft_model")
        return
    target_ids, draft_ids = _id_to_token(target_tokenizer), _id_to_token(draft_tokenizer)
    common = sorted(set(target_ids) & set(draft_ids))
    differ = [i for i in common if target_ids[i] != draft_ids[i]]
    if differ or not common:
        i = differ[0] if differ else None
        what = (f"token id {i} is {target_ids[i]!r} for the target but {draft_ids[i]!r} for the draft "
                f"({len(differ)} of {len(common)} shared ids differ)" if differ else "the tokenizers share no ids")
        raise VocabMismatchError(f"draft model {draft_dir} has a different vocabulary: {what}; {hint}",
                                 field="draft_model")
    missing = [i for i in target_ids if i not in draft_ids and i < tv]
    if len(missing) > max(16, len(target_ids) // 100):  # a few extra specials are fine; a different vocab is not
        raise VocabMismatchError(f"draft model {draft_dir} lacks {len(missing)} of the target's {len(target_ids)} "
                                 f"token ids (first: {missing[0]}); {hint}", field="draft_model")
