"""Fill in the middle: a prompt made of the text before and after a gap, for code models trained on it (the
OpenAI completions API's `suffix`). Every family we load uses the prefix-suffix-middle order with its own three
marker tokens; the model then writes the middle."""

from __future__ import annotations

from exl2_backend.errors import TokenizerError

# (before the prefix, before the suffix, before the middle), as each family's vocabulary spells them
FIM_MARKERS = (
    ("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"),  # Qwen2.5-Coder, Granite code
    ("<fim_prefix>", "<fim_suffix>", "<fim_middle>"),  # StarCoder, SantaCoder, Refact
    ("<｜fim▁begin｜>", "<｜fim▁hole｜>", "<｜fim▁end｜>"),  # DeepSeek-Coder
    ("▁<PRE>", "▁<SUF>", "▁<MID>"),  # CodeLlama
)


def fim_marker_ids(tokenizer) -> tuple[int, int, int] | None:
    """The model's (prefix, suffix, middle) marker ids, or None when it has no fill-in-the-middle tokens."""
    for names in FIM_MARKERS:
        ids = [tokenizer.token_to_id(n) for n in names]
        if all(i is not None for i in ids):
            return ids[0], ids[1], ids[2]
    return None


def infill_ids(tokenizer, prefix: str, suffix: str, *, limit: int | None = None) -> list[int]:
    """[BOS when the model wants one] P prefix S suffix M: the prompt whose continuation is the middle.
    TokenizerError for a model without the markers; `limit` as in Tokenizer.encode, for each text."""
    markers = fim_marker_ids(tokenizer)
    if markers is None:
        raise TokenizerError("this model has no fill-in-the-middle tokens (none of "
                             f"{', '.join(m[0] for m in FIM_MARKERS)}), so a suffix cannot be used")
    p, s, m = markers
    head = tokenizer.encode(prefix, add_special_tokens=False, limit=limit)
    tail = tokenizer.encode(suffix, add_special_tokens=False, limit=limit)
    return tokenizer.with_bos([p, *head, s, *tail, m])
