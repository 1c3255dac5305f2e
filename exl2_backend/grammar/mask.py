"""Grammar masks applied to logits rows (pure torch; the rows are few and small beside a forward)."""

from __future__ import annotations

import torch

_BITS = torch.arange(32, dtype=torch.int32)  # [32]
_bits_on: dict[torch.device, torch.Tensor] = {}  # _BITS per device: a fresh copy would wait for the device


def _bits(device: torch.device) -> torch.Tensor:
    bits = _bits_on.get(device)
    if bits is None:
        bits = _bits_on[device] = _BITS.to(device)
    return bits


def mask_words(vocab_size: int) -> int:
    """int32 words of one token bitmask (bit t % 32 of word t // 32 allows token t)."""
    return (vocab_size + 31) // 32


def word_bit(b: int) -> int:
    """Bit b of an int32 mask word, as a Python int in int32's range (bit 31 is the sign)."""
    return (1 << b) - (1 << 32) if b == 31 else 1 << b


def grammar_masks(grammars: list, words: int, pin: bool) -> torch.Tensor:
    """One bitmask row per entry of `grammars` (a SequenceGrammar, or None for an unconstrained row, all ones):
    int32 [B, words] on the CPU (pinned when `pin`, for an asynchronous copy to the GPU)."""
    masks = torch.full((len(grammars), words), -1, dtype=torch.int32, pin_memory=pin)  # [B, W]
    for i, g in enumerate(grammars):
        if g is not None:
            g.fill_mask(masks[i])
    return masks


def apply_grammar_masks(logits: torch.Tensor, masks: torch.Tensor) -> torch.Tensor:
    """logits f32 [B, V], masks int32 [B, W] (CPU) -> logits with every token a mask does not allow at -inf. A row
    whose mask allows nothing becomes NaN: both samplers flag a NaN row (NAN_ROW) instead of drawing from it, so
    the sequence fails with a message rather than emitting a token its grammar forbids."""
    v = logits.shape[1]
    empty = allows_nothing(masks, v)  # [B] on the host
    bits = (masks.to(logits.device, non_blocking=True).unsqueeze(-1) >> _bits(logits.device)) & 1  # [B, W, 32]
    allowed = bits.reshape(masks.shape[0], -1)[:, :v].bool()  # [B, V] (tokens past W * 32 are none)
    logits = logits.masked_fill(~allowed, float("-inf"))
    if bool(empty.any()):
        logits[empty.to(logits.device)] = float("nan")
    return logits


def allows_nothing(masks: torch.Tensor, v: int) -> torch.Tensor:
    """masks int32 [B, W] -> bool [B]: rows that allow no id below `v` (ids past the logits' width, e.g. tokenizer
    tokens the embedding lacks, do not count: an all -inf row would give greedy token 0)."""
    full, rest = divmod(v, 32)
    any_set = masks[:, :full].ne(0).any(dim=1)
    if rest:
        any_set |= (masks[:, full] & ((1 << rest) - 1)).ne(0)
    return ~any_set
