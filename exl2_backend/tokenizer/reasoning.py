"""Reasoning replies: a model trained to think first (DeepSeek-R1 distills of Llama and Qwen2, QwQ, ...) writes
`<think> ... </think>` before its answer; Magistral (mistral-common v13+) writes `[THINK] ... [/THINK]`. The
OpenAI-style servers return the thinking apart, as the message's `reasoning_content`, and only the answer as
`content`.

Whether a model does this, and with which tags, is read from its chat template (it mentions the closing tag,
usually to drop the thinking from earlier turns) and its vocabulary (the tag is one token). Some templates open the
block themselves at the end of the generation prompt, so the reply starts inside it; `ReasoningSplitter` is told so.

The tags stay in the decoded text even where a tokenizer marks them special (tokenizer.py keeps their ids out of
the skipped set): the reply is split on them here, and a client that reads the raw text sees them too."""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
TAG_PAIRS = ((THINK_OPEN, THINK_CLOSE), ("[THINK]", "[/THINK]"))  # the conventions known, the first the default


@dataclass(frozen=True)
class ReasoningTags:
    open: str = THINK_OPEN
    close: str = THINK_CLOSE
    prompt_opens: bool = False  # the generation prompt ends with `open`: the reply begins inside the block
    added: bool = False  # both tags are added tokens, which grammars can name (grammar/spec.py "reasoning")
    open_id: int | None = None  # the tags' ids where each is one token (usage's reasoning_tokens count)
    close_id: int | None = None

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict | None) -> ReasoningTags | None:
        return None if not d else cls(**d)

    def token_count(self, ids: list[int], inside: bool) -> int:
        """How many of a reply's tokens `ids` are thinking (the closing tag included): up to the closing tag's
        token; all of them when the block never closed (a reply begun inside it, or opening it)."""
        if self.close_id is not None and self.close_id in ids:
            return ids.index(self.close_id) + 1
        if inside or (ids and self.open_id is not None and ids[0] == self.open_id):
            return len(ids)
        return 0

    def grammar_field(self, inside: bool) -> dict | None:
        """A grammar's "reasoning" field (grammar/spec.py): the model thinks, then the output is constrained; None
        where the tags are not tokens a grammar can name (then the grammar holds the reply from its start). A tag
        not spelled <...> ([THINK]) is named by its id, <[id]>."""
        if not self.added:
            return None
        return {"open": _token_name(self.open, self.open_id), "close": _token_name(self.close, self.close_id),
                "inside": inside}


def _token_name(tag: str, token_id: int | None) -> str:
    return tag if re.fullmatch(r"<[^<>\s\[\]]+>", tag) or token_id is None else f"<[{token_id}]>"


def template_tags(source: str | None) -> tuple[str, str] | None:
    """The tags a reasoning model's chat template handles (it mentions the closing one), or None."""
    return next((pair for pair in TAG_PAIRS if source and pair[1] in source), None)


def template_reasons(source: str | None) -> bool:
    """Whether a chat template is a reasoning model's (it handles a known closing tag)."""
    return template_tags(source) is not None


class ReasoningSplitter:
    """A reply's text, fed in pieces, split into (reasoning, content) deltas: what is inside the tags goes to
    reasoning, the rest to content; the tags themselves and the whitespace right after each are dropped. A piece
    that may be the start of a tag is held until the next one shows what it is; `feed(..., final=True)` releases
    everything. Feeding a whole reply at once gives the same texts as feeding it piece by piece."""

    def __init__(self, tags: ReasoningTags, inside: bool | None = None):
        """inside: whether the reply begins inside the block (default: the generation prompt opens it)."""
        self.tags = tags
        self.state = "reasoning" if (tags.prompt_opens if inside is None else inside) else "start"
        self.buf = ""
        self.trim = True  # drop whitespace at the start of the current part

    def feed(self, text: str, final: bool = False) -> tuple[str, str]:
        self.buf += text
        reasoning, content = [], []
        while True:
            if self.trim:
                self.buf = self.buf.lstrip()
                if not self.buf:
                    return "".join(reasoning), "".join(content)
                self.trim = False
            if self.state == "start":  # the reply's first characters: the opening tag, or the answer
                if self.buf.startswith(self.tags.open):
                    self.buf, self.state, self.trim = self.buf[len(self.tags.open):], "reasoning", True
                    continue
                if self.tags.open.startswith(self.buf) and not final:
                    break  # may still become the tag
                self.state = "content"
            if self.state == "content":
                content.append(self.buf)
                self.buf = ""
                break
            end = self.buf.find(self.tags.close)
            if end >= 0:
                reasoning.append(self.buf[:end])
                self.buf, self.state, self.trim = self.buf[end + len(self.tags.close):], "content", True
                continue
            keep = 0 if final else _partial_suffix(self.buf, self.tags.close)
            reasoning.append(self.buf[: len(self.buf) - keep])
            self.buf = self.buf[len(self.buf) - keep:]
            break
        return "".join(reasoning), "".join(content)


def split_reasoning(text: str, tags: ReasoningTags, inside: bool | None = None) -> tuple[str | None, str | None]:
    """A whole reply -> (reasoning or None, content or None)."""
    reasoning, content = ReasoningSplitter(tags, inside).feed(text, final=True)
    return reasoning or None, content or None


def continues_inside(tags: ReasoningTags, begun: str) -> bool:
    """Whether a reply that continues an assistant message begun with `begun` (continue_final_message) is inside
    the block: the message opened it and did not close it."""
    opened = begun.rfind(tags.open)
    return opened >= 0 and tags.close not in begun[opened:]


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest end of `text` that is a proper beginning of `tag` (held back: it may be the tag)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0
