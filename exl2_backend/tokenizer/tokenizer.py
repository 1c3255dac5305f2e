"""`Tokenizer`: a Hugging Face model directory's tokenizer, without transformers.

Reads `tokenizer.json` with the `tokenizers` library, the special tokens and chat template from
`tokenizer_config.json` (or `chat_template.jinja` / `chat_template.json`), and the end-of-sequence ids from
`generation_config.json` and `config.json`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tokenizers import AddedToken
from tokenizers import Tokenizer as _HFTokenizer

from exl2_backend.errors import PromptTooLongError, TokenizerError
from exl2_backend.text import unicode_problem
from exl2_backend.tokenizer.chat_template import cut_after_final_content, render, select_template
from exl2_backend.tokenizer.incremental import IncrementalDecoder
from exl2_backend.tokenizer.reasoning import TAG_PAIRS, ReasoningTags, template_tags
from exl2_backend.tokenizer.tool_formats import (
    HERMES,
    MISTRAL_V11_TOKENS,
    ToolCallFormat,
    detect_format_name,
    template_takes_tools,
    tool_call_format,
)
from exl2_backend.tokenizer.tool_prompt import hermes_messages, template_messages

_SPECIAL_NAMES = ("bos_token", "eos_token", "pad_token", "unk_token")
# transformers' `clean_up_tokenization_spaces` rules, applied only when the config asks for them.
_CLEANUPS = ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"), (" n't", "n't"), (" 'm", "'m"),
             (" 's", "'s"), (" 've", "'ve"), (" 're", "'re"))


# Normalizers that never shrink text by more than 3:1 (Unicode compositions: three jamo into one syllable) and
# remove nothing; with any other (Strip, StripAccents, BertNormalizer's control-character removal, ...) text
# may shrink without bound and min_tokens gives no bound.
_BOUNDED_NORMALIZERS = {"NFC": 3, "NFD": 3, "NFKC": 3, "NFKD": 3, "Lowercase": 3, "Prepend": 1, "Replace": 1}


def _normalizer_shrink(spec) -> int:
    """How many times shorter (in UTF-8 bytes) normalization can make a text: 1, 3, or 0 for unbounded."""
    if spec is None:
        return 1
    kind = spec.get("type")
    if kind == "Sequence":
        factor = 1
        for part in spec.get("normalizers", []):
            f = _normalizer_shrink(part)
            if f == 0:
                return 0
            factor *= f
        return factor
    if kind == "Replace" and not spec.get("content"):
        return 0  # replacing with nothing removes text
    return _BOUNDED_NORMALIZERS.get(kind, 0)


def _bytes_per_token_bound(tok: _HFTokenizer) -> int:
    """Most input bytes one token can stand for, times the normalizer's shrink (0: unknown, no bound)."""
    try:
        shrink = _normalizer_shrink(json.loads(tok.to_str()).get("normalizer"))
    except (ValueError, AttributeError):
        return 0
    longest = max((len(t.encode("utf-8", "surrogatepass")) for t in tok.get_vocab(with_added_tokens=True)),
                  default=0)
    return longest * shrink


def _present(path: Path) -> bool:
    """Whether the optional file is there; a directory (or other non-file) in its place is an error, not a
    silently missing chat template or EOS id."""
    if path.exists() and not path.is_file():
        raise TokenizerError(f"{path.name} is not a regular file (path {path})")
    return path.is_file()


def _read_json(path: Path, required: bool = False) -> dict:
    if not _present(path):
        if required:
            raise TokenizerError(f"missing {path.name} (file {path})")
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise TokenizerError(f"cannot read {path.name}: {exc} (file {path})") from exc
    if not isinstance(data, dict):
        raise TokenizerError(f"{path.name} must hold a JSON object (file {path})")
    return data


def _token_text(value: Any) -> str | None:
    """A special token as configs write it: a string, or an AddedToken dict with `content`."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _ids(value: Any) -> list[int]:
    if isinstance(value, int) and not isinstance(value, bool):
        return [value]
    if isinstance(value, list):
        return [v for v in value if isinstance(v, int) and not isinstance(v, bool)]
    return []


class Tokenizer:
    """Encode/decode, special ids and chat templating for one model directory."""

    def __init__(self, backend: _HFTokenizer, config: dict | None = None, *, chat_template: Any = None,
                 extra_eos_ids: list[int] = (), fallback_bos_id: int | None = None, source: str | None = None):
        self._tok = backend
        self.source = source
        config = config or {}
        self._add_extra_tokens(config.get("added_tokens_decoder") or {})
        self.special_tokens: dict[str, str | None] = {n: _token_text(config.get(n)) for n in _SPECIAL_NAMES}
        bos = self.special_tokens["bos_token"]
        self.bos_token_id: int | None = self.token_to_id(bos) if bos else fallback_bos_id
        eos = self.special_tokens["eos_token"]
        pad = self.special_tokens["pad_token"]
        self.pad_token_id: int | None = self.token_to_id(pad) if pad else None
        eos_ids = set(extra_eos_ids)
        if eos and self.token_to_id(eos) is not None:
            eos_ids.add(self.token_to_id(eos))
        self.eos_token_ids: set[int] = eos_ids
        self.eos_token_id: int | None = self.token_to_id(eos) if eos else min(eos_ids, default=None)
        self.add_bos_token: bool | None = config.get("add_bos_token")
        self.clean_up_tokenization_spaces = bool(config.get("clean_up_tokenization_spaces", False))
        self.chat_template_source = chat_template if chat_template is not None else config.get("chat_template")
        # skipped when decoding output; reasoning and tool-call tags never are: replies are split on them
        # (tokenizer/reasoning.py, serve/tools.py)
        kept = {self.token_to_id(t) for t in (*(tag for pair in TAG_PAIRS for tag in pair), *HERMES.tags)}
        if self.token_to_id("[ARGS]") is not None:  # a Mistral v11+ vocabulary: calls are read from these tokens
            kept |= {self.token_to_id(t) for t in MISTRAL_V11_TOKENS}
        self.special_ids: frozenset[int] = frozenset(
            i for i, t in self._tok.get_added_tokens_decoder().items() if t.special and i not in kept)
        # Does the post-processor (e.g. Llama's TemplateProcessing) already put BOS in front?
        probe = self._tok.encode("", add_special_tokens=True).ids
        self._post_adds_bos = bool(probe) and probe[0] == self.bos_token_id
        self._bytes_per_token: int | None = None  # min_tokens' divisor, found on first use (0: no bound)

    # --- construction -------------------------------------------------------------------------------

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> Tokenizer:
        """Load `model_dir/tokenizer.json` and its companions; `TokenizerError` names any bad file."""
        model_dir = Path(model_dir)
        path = model_dir / "tokenizer.json"
        if not path.is_file():
            raise TokenizerError(f"missing tokenizer.json (file {path})")
        try:
            backend = _HFTokenizer.from_file(str(path))
        except Exception as exc:  # the Rust side raises bare Exceptions for malformed JSON / models
            raise TokenizerError(f"invalid tokenizer.json: {exc} (file {path})") from exc
        config = _read_json(model_dir / "tokenizer_config.json")
        template: Any = None
        jinja = model_dir / "chat_template.jinja"
        if _present(jinja):
            try:
                template = jinja.read_text(encoding="utf-8")
            except (OSError, UnicodeDecodeError) as exc:
                raise TokenizerError(f"cannot read chat_template.jinja: {exc} (file {jinja})") from exc
        elif _present(model_dir / "chat_template.json"):
            template = _read_json(model_dir / "chat_template.json").get("chat_template")
        gen = _read_json(model_dir / "generation_config.json")
        model_config = _read_json(model_dir / "config.json")
        extra_eos = _ids(gen.get("eos_token_id")) + _ids(model_config.get("eos_token_id"))
        fallback_bos = (_ids(gen.get("bos_token_id")) or _ids(model_config.get("bos_token_id")) or [None])[0]
        return cls(backend, config, chat_template=template, extra_eos_ids=extra_eos, fallback_bos_id=fallback_bos,
                   source=str(model_dir))

    def _add_extra_tokens(self, decoder: Any) -> None:
        """Register tokens that `added_tokens_decoder` lists but tokenizer.json lacks (rare, older exports)."""
        if not isinstance(decoder, dict):
            raise TokenizerError(f"tokenizer_config.json: added_tokens_decoder must be an object of id -> token, "
                                 f"got {type(decoder).__name__} (file {self.source})")
        for entry in decoder.values():
            content = _token_text(entry)
            if content is None or self._tok.token_to_id(content) is not None:
                continue
            if not isinstance(entry, dict):  # a bare string names a token tokenizer.json lacks: no flags to add it by
                raise TokenizerError(f"tokenizer_config.json: added_tokens_decoder entry {entry!r} is not in "
                                     f"tokenizer.json and has no AddedToken fields (file {self.source})")
            token = AddedToken(content, special=bool(entry.get("special", False)),
                               normalized=bool(entry.get("normalized", False)), lstrip=bool(entry.get("lstrip")),
                               rstrip=bool(entry.get("rstrip")), single_word=bool(entry.get("single_word")))
            if token.special:
                self._tok.add_special_tokens([token])
            else:
                self._tok.add_tokens([token])

    # --- vocabulary ---------------------------------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        """Number of token ids, added tokens included."""
        return self._tok.get_vocab_size(with_added_tokens=True)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self._tok.id_to_token(token_id)

    @property
    def backend(self) -> _HFTokenizer:
        """The underlying `tokenizers.Tokenizer` (used by the incremental decoder)."""
        return self._tok

    # --- encode / decode ----------------------------------------------------------------------------

    def min_tokens(self, text: str) -> int:
        """A lower bound on len(encode(text)) that costs a byte count, not a tokenization (0 where none is known):
        no token covers more input bytes than its vocabulary string has UTF-8 bytes (byte-level and
        SentencePiece alphabets only overestimate), and normalizers that shrink text do so at most 3:1
        (compositions), or the bound is not used (stripping normalizers)."""
        if self._bytes_per_token is None:
            self._bytes_per_token = _bytes_per_token_bound(self._tok)
        return len(text.encode("utf-8", "surrogatepass")) // self._bytes_per_token if self._bytes_per_token else 0

    def encode(self, text: str, add_special_tokens: bool = True, *, add_bos: bool | None = None,
               limit: int | None = None) -> list[int]:
        """Token ids of `text`. Special-token text such as `<|im_start|>` maps to its id.

        `add_special_tokens` runs the post-processor and honours `add_bos_token`; `add_bos` (if given)
        forces BOS on or off regardless. `limit`: PromptTooLongError, without tokenizing, for a text that is
        sure to exceed that many tokens (min_tokens): a 9 MB prompt took the engine thread 8 s to tokenize.
        """
        if not isinstance(text, str):
            raise TokenizerError(f"encode expects a str, got {type(text).__name__}")
        if limit is not None and (least := self.min_tokens(text)) > limit:
            raise PromptTooLongError(f"the prompt has at least {least} tokens ({len(text)} characters), more than "
                                     f"the {limit} this context holds", limit=limit, length=least)
        try:
            ids = self._tok.encode(text, add_special_tokens=add_special_tokens).ids
        except Exception as exc:  # e.g. TypeError for a str that is not valid Unicode
            raise TokenizerError(f"cannot encode the text: {unicode_problem(text) or exc}") from exc
        want_bos = add_bos if add_bos is not None else (self.add_bos_token if add_special_tokens else None)
        has_bos = bool(ids) and ids[0] == self.bos_token_id
        if want_bos is True and not has_bos and self.bos_token_id is not None:
            ids.insert(0, self.bos_token_id)
        elif want_bos is False and has_bos and add_special_tokens and self._post_adds_bos:
            ids.pop(0)  # the post-processor's BOS, which the config (or caller) turned off
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        text = self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)
        if self.clean_up_tokenization_spaces:
            for old, new in _CLEANUPS:
                text = text.replace(old, new)
        return text

    def incremental_decoder(self, skip_special_tokens: bool = True) -> IncrementalDecoder:
        """A fresh streaming decoder for one sequence."""
        return IncrementalDecoder(self._tok, skip_special_tokens=skip_special_tokens, special_ids=self.special_ids)

    # --- chat ---------------------------------------------------------------------------------------

    @property
    def has_chat_template(self) -> bool:
        return self.chat_template_source is not None

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, *,
                            template_name: str | None = None, continue_final_message: bool = False,
                            **kwargs: Any) -> str:
        """Render the chat template (transformers' `tokenize=False` output). Extra kwargs reach it. `tools` (OpenAI
        tool definitions), assistant `tool_calls` and `tool` messages go to a template written for tools as they
        are, and into a template that never mentions them in the Hermes convention (tokenizer/tool_prompt.py).

        continue_final_message: the text ends where the last message's content ends (its end-of-turn cut), so the
        model continues that message, e.g. an assistant reply the caller began ("prefill")."""
        if continue_final_message:
            if add_generation_prompt:
                raise TokenizerError("continue_final_message continues the last message; it cannot go with "
                                     "add_generation_prompt, which starts a new one")
            text = self.apply_chat_template(messages, False, template_name=template_name, **kwargs)
            return cut_after_final_content(text, messages)
        tools = kwargs.pop("tools", None)
        source = self._template(template_name, tools is not None)
        if source is None:
            raise TokenizerError(f"this model has no chat template (tokenizer_config.json in {self.source})")
        if template_takes_tools(source):
            messages = template_messages(messages,
                                         nine_char_ids=tool_call_format(detect_format_name(source)).nine_char_ids)
            if tools is not None:
                kwargs["tools"] = tools
        elif tools or any(m.get("role") == "tool" or m.get("tool_calls") for m in messages):
            messages = hermes_messages(messages, tools)
        return render(source, messages, add_generation_prompt=add_generation_prompt,
                      special_tokens=self.special_tokens, **kwargs)

    def _template(self, name: str | None, with_tools: bool) -> str | None:
        """The template text; with tools and no name, the one called "tool_use" where the model has one (as
        transformers picks it)."""
        value = self.chat_template_source
        if name is None and with_tools and isinstance(value, list) and any(
                isinstance(t, dict) and t.get("name") == "tool_use" for t in value):
            name = "tool_use"
        return select_template(value, name)

    def tool_call_format(self, name: str = "auto") -> ToolCallFormat:
        """How this model writes tool calls (tokenizer/tool_formats.py): `name`, or with "auto" the convention
        its chat template asks for; the marker token's id where the vocabulary has it."""
        if name == "auto":
            name = detect_format_name(self._template_or_none(with_tools=True))
        fmt = tool_call_format(name)
        added = self._tok.get_added_tokens_decoder()
        marker = self.token_to_id(fmt.marker) if fmt.marker else None
        # tags that are added tokens: grammars name them as tokens (llguidance takes an added <...> token as
        # special, so the tag's text spelled in a grammar would not match the model's token)
        tags = [self.token_to_id(t) for t in fmt.tags] if fmt.tags else []
        args = self.token_to_id(fmt.args_marker) if fmt.args_marker else None
        return tool_call_format(name, marker, tags if tags and all(i in added for i in tags) else None, args,
                                self._takes_parallel_calls())

    def _takes_parallel_calls(self) -> bool:
        """Whether the chat template renders a turn holding two calls (Llama 3.1's raises "This model only supports
        single tool-calls at once!"): if it renders one call but not two, replies are held to one call, so each can
        go back into the next turn's history. True where it cannot tell."""
        source = self._template_or_none(with_tools=True)
        if not source or not template_takes_tools(source):
            return True
        tools = [{"type": "function", "function": {"name": "f", "description": "A probe.", "parameters": {
            "type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}}}]

        def turn(n: int) -> list[dict]:
            calls = [{"id": f"probe000{i}", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}
                     for i in range(n)]
            return ([{"role": "user", "content": "Hi."}, {"role": "assistant", "content": "", "tool_calls": calls}]
                    + [{"role": "tool", "tool_call_id": c["id"], "content": "1"} for c in calls]
                    + [{"role": "user", "content": "And?"}])

        def renders(n: int) -> bool:
            try:
                self.apply_chat_template(turn(n), tools=tools)
                return True
            except (TokenizerError, TypeError, ValueError, KeyError, IndexError):
                return False

        return renders(2) or not renders(1)

    def reasoning_tags(self, mode: str = "auto") -> ReasoningTags | None:
        """The tags a reasoning reply thinks inside (tokenizer/reasoning.py), or None: with "auto" where the chat
        template handles them and the closing tag is one token, with "think" always, with "none" never. Whether
        the generation prompt opens the block is read from a rendered probe chat."""
        if mode == "none":
            return None
        pair = template_tags(self._template_or_none(False))  # the template's tags, where its closing one is a token
        if pair is None or self.token_to_id(pair[1]) is None:
            if mode == "auto":
                return None
            # "think": the first convention this vocabulary has as a token, else <think> as text
            pair = next((p for p in TAG_PAIRS if self.token_to_id(p[1]) is not None), TAG_PAIRS[0])
        try:
            probe = self.apply_chat_template([{"role": "user", "content": "Hi."}], True)
        except (TokenizerError, TypeError, ValueError):  # no template, or one that wants other messages
            probe = ""
        added = self._tok.get_added_tokens_decoder()
        ids = (self.token_to_id(pair[0]), self.token_to_id(pair[1]))
        return ReasoningTags(open=pair[0], close=pair[1], prompt_opens=probe.rstrip().endswith(pair[0]),
                             added=all(i in added for i in ids), open_id=ids[0], close_id=ids[1])

    def _template_or_none(self, with_tools: bool) -> str | None:
        """_template(None, with_tools), None for a malformed template list (which renders nothing either)."""
        try:
            return self._template(None, with_tools)
        except TokenizerError:
            return None

    def encode_chat(self, messages: list[dict], add_generation_prompt: bool = True, *, limit: int | None = None,
                    **kwargs: Any) -> list[int]:
        """Ids of the rendered chat. Templates usually write BOS themselves, so BOS is only added when the
        model wants one and the rendering does not already start with it. `limit` as in encode."""
        ids = self.encode(self.apply_chat_template(messages, add_generation_prompt, **kwargs), add_special_tokens=False,
                          limit=limit)
        return self.with_bos(ids)

    def with_bos(self, ids: list[int]) -> list[int]:
        """`ids` (built without special tokens) with BOS in front when the model wants one (its config, else its
        post-processor) and they do not start with it already."""
        wants_bos = self.add_bos_token is True or (self.add_bos_token is None and self._post_adds_bos)
        if wants_bos and self.bos_token_id is not None and (not ids or ids[0] != self.bos_token_id):
            ids.insert(0, self.bos_token_id)
        return ids
