"""Data types of the hook API (hook API version `exl2_backend._version.HOOK_API_VERSION`).

Plain dataclasses and exceptions: importing this module never imports torch, so a host can build requests,
read events and catch errors without the engine's dependencies. See docs/hooks.md for the contract.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

from exl2_backend.errors import Exl2Error, InvalidRequestError
from exl2_backend.sampling import SAMPLING_RANGES, generation_field_problem  # torch-free, like this module

FinishReason = Literal["stop", "length", "cancelled", "error"]
FINISH_REASONS = ("stop", "length", "cancelled", "error")

#: Why a request was refused at admission (tier 1).
RejectReason = Literal["prompt_too_long", "no_capacity", "invalid_request", "duplicate_id"]


# --- requests ----------------------------------------------------------------------------------------------


@dataclass
class SequenceRequest:
    """One sequence a host wants generated. The host chooses `seq_id` (any string unique among its live
    sequences) and gives exactly one of `prompt_ids` (token ids, used as is), `prompt` (text, tokenized with
    the model's BOS rule) or `messages` (chat messages, rendered with the model's chat template).

    max_new_tokens None means "until the context (max_seq_len) is full". A prompt plus max_new_tokens past the
    context is cut to what fits (finish_reason "length") when `cap_to_context` is true, and refused as
    `prompt_too_long` when it is false (the OpenAI API's rule for an explicit max_tokens). Sampling:
    temperature 0 = greedy, top_k 0 / top_p 1 / min_p 0 / penalties 1 and 0 = off; seed None = fresh entropy.
    Stop strings end the sequence with the match removed from the text; stop_token_ids end it like EOS."""

    seq_id: str
    prompt_ids: list[int] | None = None
    prompt: str | None = None
    messages: list[dict] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False  # the prompt ends inside the last message: the model continues it (1.4)
    max_new_tokens: int | None = 256
    min_new_tokens: int = 0  # EOS and stop_token_ids are not sampled before this many tokens (API 1.4)
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    cap_to_context: bool = True
    logprobs: int | None = None  # None: none; n in [0, 20]: each token's logprob and the n most likely (API 1.3)
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit, in [-100, 100] (API 1.3)
    prompt_logprobs: int | None = None  # None: none; n in [0, 20]: each prompt token's logprob too (API 1.3)
    grammar: dict | None = None  # {"type": json_object | json_schema | regex | lark | choice, "value": ...}: the
    # output is constrained to it and ends when it is complete (API 1.4; exl2_backend/grammar/spec.py; 1.5: an
    # optional "reasoning" {"open", "close", "inside"} lets a reasoning model think before the constrained output)
    suffix: str | None = None  # with `prompt`: the text after the gap; the model fills in the middle (API 1.4)
    tools: list[dict] | None = None  # OpenAI tool definitions rendered into the chat prompt with `messages` (API 1.4;
    # tokenizer/tool_prompt.py); the reply's form is the host's grammar
    chat_template_kwargs: dict[str, Any] | None = None  # extra variables of the chat template, e.g. a Llama 3.1
    # template's date_string or a reasoning template's enable_thinking (API 1.6; vLLM's request field)

    def validate(self) -> None:
        """Raise `AdmissionRejected(reason="invalid_request", field=...)` for a malformed request (cheap, no
        engine needed; the backend runs it again at admission)."""

        def bad(field_name: str, message: str):
            raise AdmissionRejected(f"{field_name}: {message}", reason="invalid_request", field=field_name,
                                    seq_id=self.seq_id if isinstance(self.seq_id, str) else None)

        if not isinstance(self.seq_id, str) or not self.seq_id:
            bad("seq_id", "must be a non-empty string chosen by the host")
        given = [n for n in ("prompt_ids", "prompt", "messages") if getattr(self, n) is not None]
        if len(given) != 1:
            bad("prompt", f"give exactly one of prompt_ids, prompt, messages (got {given or 'none'})")
        if self.prompt_ids is not None and (not isinstance(self.prompt_ids, (list, tuple)) or not self.prompt_ids
                                            or not all(_is_int(t) and t >= 0 for t in self.prompt_ids)):
            bad("prompt_ids", "must be a non-empty list of non-negative token ids")
        if self.prompt is not None and (not isinstance(self.prompt, str) or not self.prompt):
            bad("prompt", "must be a non-empty string")
        if self.messages is not None and (not isinstance(self.messages, list) or not self.messages
                                          or not all(isinstance(m, dict) and "role" in m for m in self.messages)):
            bad("messages", "must be a non-empty list of {'role': ..., 'content': ...} objects")
        if self.suffix is not None and (not isinstance(self.suffix, str) or self.prompt is None):
            bad("suffix", "must be a string, given with a text prompt (the text after the gap to fill in)")
        if self.tools is not None and (self.messages is None or not isinstance(self.tools, list) or not all(
                isinstance(t, dict) and isinstance((t.get("function") or {}).get("name"), str) for t in self.tools)):
            bad("tools", "must be a list of {'type': 'function', 'function': {'name': ...}} with chat messages")
        if self.max_new_tokens is not None and (not _is_int(self.max_new_tokens) or self.max_new_tokens < 1):
            bad("max_new_tokens", f"must be an integer >= 1 or None, got {self.max_new_tokens!r}")
        for name, (ok, rule) in SAMPLING_RANGES.items():
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                bad(name, f"must be a finite number, got {value!r}")
            if not ok(value):
                bad(name, f"must be {rule}, got {value!r}")
        if not _is_int(self.top_k) or self.top_k < 0:
            bad("top_k", f"must be an integer >= 0 (0 = off), got {self.top_k!r}")
        if self.seed is not None and (not _is_int(self.seed) or not 0 <= self.seed < 1 << 64):
            bad("seed", f"must be an integer in [0, 2^64), got {self.seed!r}")
        if not isinstance(self.stop, list) or not all(isinstance(s, str) and s for s in self.stop):
            bad("stop", "must be a list of non-empty strings")
        if not isinstance(self.stop_token_ids, list) or not all(_is_int(t) and t >= 0 for t in self.stop_token_ids):
            bad("stop_token_ids", "must be a list of non-negative token ids")
        problem = generation_field_problem(self)
        if problem is not None:
            bad(*problem)
        for name in ("ignore_eos", "add_generation_prompt", "cap_to_context", "continue_final_message"):
            if not isinstance(getattr(self, name), bool):  # "no" is truthy: only real booleans
                bad(name, f"must be true or false, got {getattr(self, name)!r}")
        problem = template_kwargs_problem(self.chat_template_kwargs, self.messages is not None)
        if problem is not None:
            bad("chat_template_kwargs", problem)
        if self.continue_final_message and (self.messages is None or self.add_generation_prompt):
            bad("continue_final_message", "continues the last chat message: needs messages and "
                                          "add_generation_prompt false")


# variables the renderer sets itself (tokenizer/chat_template.render, Tokenizer.apply_chat_template)
RESERVED_TEMPLATE_VARIABLES = frozenset(("messages", "add_generation_prompt", "tools", "continue_final_message",
                                         "template_name", "bos_token", "eos_token", "unk_token", "pad_token"))
MAX_TEMPLATE_KWARGS = 32


def template_kwargs_problem(kwargs: Any, has_messages: bool) -> str | None:
    """Why `chat_template_kwargs` is refused, or None: a mapping of at most MAX_TEMPLATE_KWARGS names (identifiers,
    none of RESERVED_TEMPLATE_VARIABLES) for a request with chat messages."""
    if kwargs is None:
        return None
    if not isinstance(kwargs, dict):
        return f"must be an object of template variables, got {type(kwargs).__name__}"
    if kwargs and not has_messages:
        return "applies to chat messages only"
    if len(kwargs) > MAX_TEMPLATE_KWARGS:
        return f"at most {MAX_TEMPLATE_KWARGS} variables, got {len(kwargs)}"
    for name in kwargs:
        if not isinstance(name, str) or not name.isidentifier():
            return f"variable names must be identifiers, got {name!r}"
        if name in RESERVED_TEMPLATE_VARIABLES:
            return f"{name!r} is set by the server (use the request's own field)"
    return None


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


@dataclass
class StepBatch:
    """What one hook call works on.

    - prefill: `new` requests are admitted (each one on its own: a rejected request yields an error event,
      the others proceed), then up to `max_chunk_size` prompt tokens run for `new` + `seq_ids` (sequences
      admitted earlier whose prompt is not finished).
    - decode: one token for each of `seq_ids`.
    - draft_verify: `drafts[seq_id]` are host-proposed next tokens; `seq_ids` defaults to the drafts' keys
      (a listed id without drafts does a plain decode step).
    - on_launched (optional, decode; hook API 1.1): a no-argument callable the backend calls once, on the
      calling thread, when the step's device work is queued and before it waits for it. Hosts publish the
      previous step's results there so their Python overlaps the GPU's work; a backend may not call it (then
      the host publishes after the hook returns). It must not call hooks."""

    seq_ids: list[str] = field(default_factory=list)
    new: list[SequenceRequest] = field(default_factory=list)
    drafts: dict[str, list[int]] = field(default_factory=dict)
    on_launched: Callable[[], None] | None = None

    def ids(self) -> list[str]:
        ids = list(self.seq_ids)
        if not ids and self.drafts:
            ids = list(self.drafts)
        return ids

    def validate(self) -> None:
        """Raise InvalidRequestError (a host bug) for a batch of the wrong shape: ids that are not a list of
        strings (a bare string would be taken character by character), `new` entries that are not
        SequenceRequest, drafts that are not lists of integer token ids (100.9 or True are not ids)."""
        check_seq_ids("StepBatch.seq_ids", self.seq_ids)
        if not isinstance(self.new, (list, tuple)) or not all(isinstance(r, SequenceRequest) for r in self.new):
            raise InvalidRequestError("StepBatch.new must be a list of SequenceRequest", field="new")
        if not isinstance(self.drafts, dict):
            raise InvalidRequestError(f"StepBatch.drafts must be a dict, got {type(self.drafts).__name__}",
                                      field="drafts")
        check_seq_ids("StepBatch.drafts", list(self.drafts))
        for sid, draft in self.drafts.items():
            if not isinstance(draft, (list, tuple)) or not all(_is_int(t) for t in draft):
                raise InvalidRequestError(f"drafts[{sid!r}] must be a list of integer token ids, got {draft!r}",
                                          field="drafts")


def check_seq_ids(name: str, ids) -> None:
    """InvalidRequestError (field: `name`'s last part) unless `ids` is a list or tuple of non-empty strings: a bare
    string would be taken character by character, and no sequence has an empty id (SequenceRequest refuses it)."""
    if not isinstance(ids, (list, tuple)) or not all(isinstance(i, str) and i for i in ids):
        raise InvalidRequestError(f"{name} must be a list of non-empty sequence id strings, got {ids!r}",
                                  field=name.rsplit(".", 1)[-1])


# --- results -----------------------------------------------------------------------------------------------


@dataclass
class Usage:
    """Token counts of one sequence so far (OpenAI names)."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens

    def to_dict(self) -> dict:
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                "total_tokens": self.total_tokens, "cached_tokens": self.cached_tokens}


@dataclass
class Timings:
    """Wall-clock milliseconds of one sequence, measured by the backend from its admission."""

    prefill_ms: float = 0.0  # admission -> first token
    decode_ms: float = 0.0  # first token -> now
    total_ms: float = 0.0
    decode_tokens_per_s: float = 0.0  # (completion_tokens - 1) / decode time
    accepted_drafts: int = 0  # draft tokens accepted over the sequence's life
    proposed_drafts: int = 0

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class Event:
    """What one hook call produced for one sequence.

    token_ids: tokens added this step (empty while the prompt is still prefilling); text: the new text,
    held back while a stop string may be forming or a UTF-8 character is incomplete (it is released when
    the sequence ends); finish_reason: None while running; usage: running totals (always set); timings:
    set on the final event; error: the `AdmissionRejected` / `SequenceFailed` when finish_reason is "error";
    prefill_remaining: prompt tokens still to run (prefill only); accepted_drafts: how many of this step's
    host drafts were accepted (draft_verify only); logprobs: one entry per token of token_ids when the request
    asked (SequenceRequest.logprobs; runtime/logprobs.logprob_entries gives the keys), else None;
    prompt_logprobs: one entry per prompt token (the first's "logprob" and "top_logprobs" None) on the event
    that completes the prompt, when the request asked (SequenceRequest.prompt_logprobs)."""

    seq_id: str
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: FinishReason | None = None
    usage: Usage = field(default_factory=Usage)
    timings: Timings | None = None
    error: BackendError | None = None
    prefill_remaining: int = 0
    accepted_drafts: int | None = None
    logprobs: list[dict] | None = None
    prompt_logprobs: list[dict] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(frozen=True)
class EngineLimits:
    """Capacity of a loaded engine. Concurrency is bounded by KV cache tokens, not by a fixed batch size:
    use `handle.can_admit(n_tokens)` / `handle.free_tokens()` for the live figure."""

    max_seq_len: int
    cache_tokens: int
    page_size: int
    max_batch_size: int
    max_chunk_size: int
    vocab_size: int
    device: str


class BackendHandle:
    """What `exl2_load` returns: an opaque engine handle the host passes back to every per-engine hook.

    Besides the hooks, a handle answers cheap capacity and tokenizer questions. Like the hooks, it must be
    used from one thread at a time (the host's engine thread)."""

    backend: str = ""
    model_id: str = ""
    limits: EngineLimits

    def can_admit(self, num_tokens: int) -> bool:  # pragma: no cover - interface
        raise NotImplementedError

    def free_tokens(self) -> int:  # pragma: no cover - interface
        raise NotImplementedError

    def tokenize(self, text: str, add_special_tokens: bool = True, *,
                 limit: int | None = None) -> list[int]:  # pragma: no cover - interface
        """Ids of a text; with add_special_tokens, the model's BOS rule applies (as for a `prompt` request).
        limit (1.5): AdmissionRejected "prompt_too_long", without tokenizing, for a text sure to have more tokens."""
        raise NotImplementedError

    def prompt_ids(self, req: SequenceRequest) -> list[int]:  # pragma: no cover - interface
        """The ids a request's prompt gets at admission (prompt_ids, prompt, or messages with the chat template,
        tools and continue_final_message); AdmissionRejected as admission would refuse it (API 1.4)."""
        raise NotImplementedError

    def detokenize(self, token_ids: list[int]) -> str:  # pragma: no cover - interface
        raise NotImplementedError

    def tool_call_format(self, name: str = "auto") -> dict:
        """How the model writes tool calls: {"name": "hermes" | "llama3_json" | "mistral" | "mistral_v11",
        "marker_id": the id of the token that begins calls, or None, "tag_ids": the ids of Hermes' <tool_call> /
        </tool_call> where they are added tokens, or None, "args_marker_id": mistral_v11's [ARGS] id, or None,
        "parallel": whether the chat template takes several calls in one turn (Llama 3.1's does not: replies hold
        one call)}; "auto" detects it from the chat template, another name is used as given (API 1.5; mistral_v11
        and parallel 1.7; tokenizer/tool_formats.py). A backend that does not say: the Hermes convention."""
        return {"name": "hermes" if name == "auto" else name, "marker_id": None, "tag_ids": None,
                "args_marker_id": None, "parallel": True}

    def reasoning_tags(self, mode: str = "auto") -> dict | None:
        """The tags a reasoning model thinks inside: {"open": "<think>", "close": "</think>", "prompt_opens": whether
        the chat's generation prompt already opened the block}, or None (not a reasoning model, or mode "none");
        "auto" reads the chat template, "think" asks for the tags anyway (API 1.5; tokenizer/reasoning.py)."""
        return None

    def generation_defaults(self) -> dict:
        """The sampling defaults the model ships (generation_config.json): {field: value} for the request fields
        among temperature, top_p, top_k, min_p, repetition_penalty and max_new_tokens it sets, for a host to give
        requests that leave them out (API 1.8; format/generation_defaults.py). A backend that does not say: {}."""
        return {}

    def render_chat(self, messages: list[dict], add_generation_prompt: bool = True) -> str:  # pragma: no cover
        raise NotImplementedError

    def tokenize_chat(self, messages: list[dict], add_generation_prompt: bool = True) -> list[int]:  # pragma: no cover
        """The prompt ids a `messages` request would get (chat template + the model's BOS rule)."""
        raise NotImplementedError


# --- errors (three tiers) ----------------------------------------------------------------------------------


class BackendError(Exl2Error):
    """Base of the hook API's errors; `tier` says what failed: 1 a request at admission, 2 one sequence,
    3 the engine."""

    tier: int = 0

    def to_dict(self) -> dict:
        d = {"type": type(self).__name__, "tier": self.tier, "message": str(self)}
        for k in ("reason", "field", "limit", "length", "retry_after", "seq_id"):
            if getattr(self, k, None) is not None:
                d[k] = getattr(self, k)
        return d


class AdmissionRejected(BackendError):
    """Tier 1: the request was not admitted; it holds no pages and nothing else changed.

    reason "prompt_too_long" (carries `limit`, `length`) and "invalid_request" / "duplicate_id" (carry
    `field`) will fail again if retried unchanged; "no_capacity" means "not now": retry after
    `retry_after` seconds or once a running sequence finishes."""

    tier = 1

    def __init__(self, message: str, *, reason: RejectReason, field: str | None = None, limit: int | None = None,
                 length: int | None = None, retry_after: float | None = None, seq_id: str | None = None):
        super().__init__(message)
        self.reason = reason
        self.field = field
        self.limit = limit
        self.length = length
        self.retry_after = retry_after
        self.seq_id = seq_id

    def __reduce__(self):
        return (_rebuild, (type(self), str(self), {k: getattr(self, k) for k in
                                                    ("reason", "field", "limit", "length", "retry_after", "seq_id")}))


class SequenceFailed(BackendError):
    """Tier 2: one sequence failed while running; its pages are already freed, other sequences continue."""

    tier = 2

    def __init__(self, message: str, *, seq_id: str | None = None):
        super().__init__(message)
        self.seq_id = seq_id

    def __reduce__(self):
        return (_rebuild, (type(self), str(self), {"seq_id": self.seq_id}))


class EngineUnhealthy(BackendError):
    """Tier 3: the engine cannot continue (e.g. a CUDA fault); every sequence is lost, reload the model.
    Raised by the per-engine hooks; the handle stays unusable."""

    tier = 3


def _rebuild(cls, message, kwargs):
    return cls(message, **kwargs)
