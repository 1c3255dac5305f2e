"""Typed configuration and the OpenAI-compatible request/response models (pydantic v2; no torch).

Requests: unknown fields are refused with a 400 naming them (as the OpenAI API does); fields the OpenAI
client may send that we do not implement are accepted at their neutral value and refused otherwise, with
a message naming the field. Sampler extensions that vLLM/TabbyAPI clients send through `extra_body`
(top_k, min_p, repetition_penalty, stop_token_ids, ignore_eos) are supported.
"""

from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, ValidationError, field_validator, model_validator

from exl2_backend.plugin.types import template_kwargs_problem
from exl2_backend.sampling import MAX_TOP_LOGPROBS, logit_bias_problem
from exl2_backend.serve.structured import ResponseFormat, StructuredOutputs, checked
from exl2_backend.serve.tools import MAX_TOOLS, NamedToolChoice, ToolCall, ToolChoice, ToolDef, tool_grammar
from exl2_backend.text import unicode_problem
from exl2_backend.tokenizer.reasoning import ReasoningTags, continues_inside
from exl2_backend.tokenizer.tool_formats import HERMES, ToolCallFormat

MAX_CHOICES = 16  # n: choices per prompt at most (each one engine sequence)
MAX_SEQUENCES = 64  # engine sequences one request may start (text completions: prompts x n)

# --- server settings (decision 10) ---------------------------------------------------------------------------


class ServeSettings(BaseModel):
    """Everything `exl2-backend serve` / `run_server` takes. Load fields (model_dir .. cache_type) go to the
    backend's exl2_load hook; the rest configure the host."""

    model_config = ConfigDict(extra="forbid")

    model_dir: str | None = None  # None: the embedded default model
    model_id: str | None = None  # name served at /v1/models; default: derived from the directory
    device: str = "auto"
    max_seq_len: int | None = Field(default=None, ge=2)
    cache_tokens: int | None = Field(default=None, ge=16)
    max_batch_size: int = Field(default=16, ge=1, le=1024)  # sequences decoding together (max concurrency)
    max_chunk_size: int | None = Field(default=None, ge=1)
    page_size: int | None = None
    cache_type: str | None = None
    max_input_len: int | None = Field(default=None, ge=1)  # tokens of one prefill forward in all (load setting)
    prefix_caching: bool | None = None  # reuse cached prompt prefixes (load setting; default on)
    draft_model: str | None = None  # speculative decoding (load settings; see exl2_backend/spec/)
    num_speculative_tokens: int | None = Field(default=None, ge=1)
    ngram: bool | None = None
    adaptive_speculation: bool | None = None
    gpu_split: list[float] | None = None  # multi-GPU load settings (exl2_backend/plan/): GB per device,
    autosplit: bool | None = None  # or every visible GPU filled in order,
    tensor_parallel: int | None = Field(default=None, ge=1)  # or tensor parallelism over N GPUs
    max_queue: int = Field(default=64, ge=0)  # requests that may wait beyond the free batch slots before 503
    queue_timeout_s: float = Field(default=120.0, gt=0)  # a request waiting longer than this gets 503
    default_max_tokens: int | None = Field(default=None, ge=1)  # when a request gives none: up to the context
    max_payload_mb: float = Field(default=32.0, gt=0)  # larger request bodies get 413 before they are parsed
    host: str = "127.0.0.1"
    port: int = Field(default=8000, ge=1024, le=65535)
    log_level: str = "warning"
    backend: str | None = None  # pick one backend when several are installed
    fast_queue: bool = False  # LitServe's ZeroMQ transport between the API server and the worker
    publish_on_launch: bool = True  # publish step i's tokens once step i+1 is queued on the GPU (engine_loop.py)
    api_key: str | None = Field(default=None, min_length=1, repr=False)  # /v1/* need "Authorization: Bearer <key>"
    # how the model writes tool calls (tokenizer/tool_formats.py); auto: the convention its chat template asks for
    tool_call_format: Literal["auto", "hermes", "llama3_json", "mistral", "mistral_v11"] = "auto"
    # a reasoning model's <think> block returned apart as reasoning_content (tokenizer/reasoning.py): auto where the
    # chat template says the model reasons, think always, none never (the reply's text as generated)
    reasoning_parser: Literal["auto", "think", "none"] = "auto"
    # sampling defaults of requests that leave a field out: auto the model's generation_config.json (vLLM's
    # --generation-config auto), none the OpenAI API's
    generation_config: Literal["auto", "none"] = "auto"

    def load_settings(self) -> dict:
        keys = ("model_dir", "model_id", "device", "max_seq_len", "cache_tokens", "max_batch_size", "max_chunk_size",
                "page_size", "cache_type", "backend", "draft_model", "num_speculative_tokens", "ngram",
                "adaptive_speculation")
        keys += ("max_input_len", "prefix_caching")
        keys += ("gpu_split", "autosplit", "tensor_parallel")
        return {k: getattr(self, k) for k in keys if getattr(self, k) is not None}


# --- requests -----------------------------------------------------------------------------------------------


# Numbers and booleans as JSON types them: pydantic's lax mode would take true as 1 token, "5" as 5 and "yes" as
# true, where the OpenAI API answers 400. Whole floats stay accepted for integers (5.0). Registered per field below.
def _json_number(value):
    if isinstance(value, (bool, str)):
        raise ValueError(f"must be a JSON number, got {value!r}")  # noqa: TRY004 - pydantic reports ValueError only
    return value


def _json_bool(value):
    if value is not None and not isinstance(value, bool):
        raise ValueError(f"must be a JSON boolean (true / false), got {value!r}")
    return value


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class StreamOptions(_Strict):
    include_usage: bool = False

    _json_types = field_validator("include_usage", mode="before")(_json_bool)


class TextPart(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")  # e.g. "refusal": null, "audio": null echoed back by clients

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant's calls earlier in the conversation
    tool_call_id: str | None = None  # a tool message: the call it answers

    @field_validator("content", mode="before")
    @classmethod
    def _text_only(cls, v):
        if isinstance(v, list):
            for part in v:
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                if kind != "text":
                    raise ValueError(f"only text content parts are supported (got {kind!r})")
        return v

    @model_validator(mode="after")
    def _content_unless_assistant(self):
        if self.content is None and self.role != "assistant":  # as the OpenAI API: only an assistant's may be null
            raise ValueError(f"a {self.role} message needs content")
        return self

    @model_validator(mode="after")
    def _tool_calls_from_the_assistant(self):
        if self.tool_calls and self.role != "assistant":
            raise ValueError(f"only an assistant message carries tool_calls, not a {self.role} message")
        return self

    def as_template_message(self) -> dict:
        """The message as chat templates take it (transformers' convention; tokenizer/tool_prompt.py)."""
        content = self.content
        if isinstance(content, list):
            content = "".join(p.text for p in content)
        role = "system" if self.role == "developer" else self.role
        out = {"role": role, "content": content or ""}
        if self.tool_calls:
            out["tool_calls"] = [c.model_dump(exclude_none=True) for c in self.tool_calls]
        if self.role == "tool" and self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        if self.role == "tool" and self.name is not None:
            out["name"] = self.name
        return out


def chat_prompt_fields(messages: list[ChatMessage], tools: list[ToolDef] | None, add_generation_prompt: bool,
                       continue_final_message: bool, template_kwargs: dict | None = None) -> dict:
    """The SequenceRequest fields of a chat prompt (what the backend renders with the chat template); the same for
    a chat completion and for /tokenize, so the two count the same ids."""
    out = {"messages": [m.as_template_message() for m in messages], "add_generation_prompt": add_generation_prompt,
           "continue_final_message": continue_final_message}
    if tools:
        out["tools"] = [t.model_dump(exclude_none=True) for t in tools]
    if template_kwargs:
        out["chat_template_kwargs"] = dict(template_kwargs)
    return out


def _template_kwargs(v):
    """chat_template_kwargs as the hook API takes them (plugin.types.template_kwargs_problem)."""
    problem = template_kwargs_problem(v, has_messages=True)
    if problem is not None:
        raise ValueError(problem)
    return v


def check_continue(add_generation_prompt: bool, continue_final_message: bool) -> None:
    if continue_final_message and add_generation_prompt:
        raise ValueError("continue_final_message needs add_generation_prompt false (one continues the last message, "
                         "the other starts a new one)")


def _reject_if_set(value, info):
    """Fields the OpenAI API defines but a local single-choice server cannot honour: 400 naming the field."""
    if value:
        raise ValueError(f"{info.field_name} is not supported by this server")
    return value


# the OpenAI API's defaults of the fields a model's generation_config.json may set instead
API_SAMPLING_DEFAULTS = {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0, "repetition_penalty": 1.0}


class _SamplingRequest(_Strict):
    """Fields shared by chat and text completions."""

    _json_numbers = field_validator("max_tokens", "temperature", "top_p", "top_k", "min_p", "presence_penalty",
                                    "frequency_penalty", "repetition_penalty", "n", "seed", "min_tokens",
                                    mode="before")(_json_number)
    _json_bools = field_validator("stream", "ignore_eos", mode="before")(_json_bool)

    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    min_tokens: int = Field(default=0, ge=0)  # vLLM's extension: no EOS / stop_token_ids before this many tokens
    # None: the server's default (the model's generation_config.json, else API_SAMPLING_DEFAULTS)
    temperature: float | None = Field(default=None, ge=0)
    top_p: float | None = Field(default=None, gt=0, le=1)
    top_k: int | None = Field(default=None, ge=0)
    min_p: float | None = Field(default=None, ge=0, le=1)
    presence_penalty: float = Field(default=0.0, ge=-2, le=2)
    frequency_penalty: float = Field(default=0.0, ge=-2, le=2)
    repetition_penalty: float | None = Field(default=None, gt=0)
    n: int = 1
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    seed: int | None = Field(default=None, ge=0, lt=1 << 64)
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    metadata: dict | None = None
    store: bool | None = None
    service_tier: str | None = None
    logit_bias: dict | None = None
    response_format: ResponseFormat | None = None  # json_object / json_schema: constrained output (serve/structured.py)
    structured_outputs: StructuredOutputs | None = None  # vLLM's extension: json, json_object, regex, choice, grammar

    @field_validator("response_format", "structured_outputs")
    @classmethod
    def _compiles(cls, v):
        if v is not None:
            checked(v.grammar() if isinstance(v, ResponseFormat) else v.as_grammar())
        return v

    @model_validator(mode="after")
    def _min_within_max(self):
        limit = self.limit()
        if limit is not None and self.min_tokens > limit:
            raise ValueError(f"min_tokens ({self.min_tokens}) must not exceed the completion's token limit ({limit})")
        return self

    def limit(self) -> int | None:  # the completion's token limit; each request type names its own field
        return self.max_tokens

    @model_validator(mode="after")
    def _one_constraint(self):
        if self.structured_outputs is not None and self.response_format is not None \
                and self.response_format.type != "text":
            raise ValueError("give response_format or structured_outputs, not both")
        return self

    def grammar(self) -> dict | None:
        """The engine's grammar (SequenceRequest.grammar) of the request's constraint, or None."""
        if self.structured_outputs is not None:
            return self.structured_outputs.as_grammar()
        return self.response_format.grammar() if self.response_format is not None else None

    @field_validator("n")
    @classmethod
    def _n_in_range(cls, v: int) -> int:
        if not 1 <= v <= MAX_CHOICES:
            raise ValueError(f"must be in [1, {MAX_CHOICES}] (choices per request), got {v}")
        return v

    @field_validator("stop")
    @classmethod
    def _stop_list(cls, v):
        if v is None:
            return None
        stops = [v] if isinstance(v, str) else list(v)
        if len(stops) > 4:
            raise ValueError(f"at most 4 stop sequences are allowed, got {len(stops)}")
        if any(not s for s in stops):
            raise ValueError("stop sequences must be non-empty strings")
        return stops

    @field_validator("stop_token_ids")
    @classmethod
    def _ids(cls, v):
        if v is not None and any(t < 0 for t in v):
            raise ValueError("stop_token_ids must be non-negative token ids")
        return v

    @field_validator("logit_bias")
    @classmethod
    def _bias(cls, v):
        """{"token id": bias} (JSON keys are strings) -> {id: bias}; ids >= 0, biases numbers in [-100, 100]."""
        if not v:
            return None
        bad = next((key for key in v if not (isinstance(key, str) and key.isdigit())), None)
        if bad is not None:
            raise ValueError(f"keys must be token ids (non-negative integers as strings), got {bad!r}")
        out = {int(key): value for key, value in v.items()}
        problem = logit_bias_problem(out)  # the engine's rule for the values
        if problem is not None:
            raise ValueError(problem)
        return {key: float(value) for key, value in out.items()}

    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def sampling_fields(self, defaults: dict | None = None) -> dict:
        """The sampling fields of the SequenceRequest; one the request leaves out takes `defaults` (the model's
        generation_config.json, ServeSettings.generation_config "auto"), else the OpenAI API's default."""
        out = {k: getattr(self, k) for k in ("presence_penalty", "frequency_penalty", "seed", "ignore_eos")}
        for k, api_default in API_SAMPLING_DEFAULTS.items():
            given = getattr(self, k)
            out[k] = given if given is not None else (defaults or {}).get(k, api_default)
        out.update(stop=list(self.stop or []), stop_token_ids=list(self.stop_token_ids or []),
                   min_new_tokens=self.min_tokens,
                   logprobs=self.logprob_count(), logit_bias=self.logit_bias, grammar=self.grammar())
        return out

    def logprob_count(self) -> int | None:
        """Alternatives per token for SequenceRequest.logprobs (None: no logprobs)."""
        return None


class ChatCompletionRequest(_SamplingRequest):
    _chat_json_numbers = field_validator("max_completion_tokens", "top_logprobs", mode="before")(_json_number)
    _chat_json_bools = field_validator("logprobs", mode="before")(_json_bool)
    messages: list[ChatMessage] = Field(min_length=1)
    _tool_format: ToolCallFormat = PrivateAttr(default=HERMES)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    tools: list[ToolDef] | None = Field(default=None, max_length=MAX_TOOLS)  # function calling (serve/tools.py)
    tool_choice: ToolChoice | None = None  # default: "auto" with tools, "none" without
    parallel_tool_calls: bool | None = None  # default true: a reply may hold several calls
    add_generation_prompt: bool = True  # vLLM's extensions: false with continue_final_message true continues the
    continue_final_message: bool = False  # last message (e.g. an assistant reply begun by the client)
    include_reasoning: bool = True  # a reasoning model's thinking returned as reasoning_content (false: dropped)
    reasoning_effort: str | None = None  # a template variable too (templates that read it, as gpt-oss's do)
    chat_template_kwargs: dict[str, Any] | None = None  # vLLM's: extra variables of the chat template
    _chat_template_kwargs = field_validator("chat_template_kwargs")(_template_kwargs)
    modalities: list[str] | None = None
    # accepted and ignored (no effect on a local model)
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None
    prompt_cache_options: dict | None = None
    safety_identifier: str | None = None
    verbosity: str | None = None
    moderation: Any | None = None
    # accepted only when empty
    functions: list[Any] | None = None
    function_call: str | dict | None = None
    audio: dict | None = None
    prediction: dict | None = None
    web_search_options: dict | None = None

    _chat_json_bools_tools = field_validator("parallel_tool_calls", "add_generation_prompt", "continue_final_message",
                                             mode="before")(_json_bool)

    @model_validator(mode="after")
    def _continue_or_start(self):
        check_continue(self.add_generation_prompt, self.continue_final_message)
        return self

    def prompt_fields(self) -> dict:
        """SequenceRequest fields of this chat's prompt."""
        kwargs = dict(self.chat_template_kwargs or {})
        if self.reasoning_effort is not None:
            kwargs.setdefault("reasoning_effort", self.reasoning_effort)
        return chat_prompt_fields(self.messages, self.tools, self.add_generation_prompt, self.continue_final_message,
                                  kwargs)

    @field_validator("functions", "audio", "prediction", "web_search_options")
    @classmethod
    def _unsupported(cls, v, info):
        return _reject_if_set(v, info)

    @field_validator("tools")
    @classmethod
    def _tools(cls, v):
        """Names unique; each function's parameters a JSON Schema that compiles (400 naming the function)."""
        if not v:
            return None
        names = [t.function.name for t in v]
        dup = next((n for n in names if names.count(n) > 1), None)
        if dup is not None:
            raise ValueError(f"function names must be unique; {dup!r} is defined twice")
        for t in v:
            if t.function.parameters is not None:
                try:
                    checked({"type": "json_schema", "value": t.function.parameters})
                except ValueError as exc:
                    raise ValueError(f"the parameters of function {t.function.name!r}: {exc}") from None
        return v

    @model_validator(mode="after")
    def _tool_choice_needs_tools(self):
        choice = self.tool_choice
        if choice not in (None, "none", "auto") and not self.tools:
            raise ValueError("tool_choice names a tool call but no tools are given")
        if isinstance(choice, NamedToolChoice) and choice.function.name not in {t.function.name for t in self.tools}:
            raise ValueError(f"tool_choice names function {choice.function.name!r}, which is not among the tools")
        if self.calls_tools() and super().grammar() is not None:
            raise ValueError("give tools or a response_format / structured_outputs constraint, not both")
        return self

    def calls_tools(self) -> bool:
        """Whether the reply may be tool calls (tools given and tool_choice not "none")."""
        return bool(self.tools) and self.tool_choice != "none"

    def reply_inside_reasoning(self, tags: ReasoningTags) -> bool:
        """Whether the reply begins inside the model's thinking block."""
        if self.continue_final_message:
            return continues_inside(tags, self.messages[-1].as_template_message()["content"])
        return tags.prompt_opens

    def use_tool_format(self, fmt: ToolCallFormat) -> None:
        """The model's convention for calls (the server learns it from the worker), which grammar() follows."""
        self._tool_format = fmt

    def grammar(self) -> dict | None:
        if self.calls_tools():
            return tool_grammar(self.tools, self.tool_choice or "auto", self.parallel_tool_calls is not False,
                                self._tool_format)
        return super().grammar()

    @field_validator("top_logprobs")
    @classmethod
    def _top_logprobs_needs_logprobs(cls, v, info):
        if v is not None and not info.data.get("logprobs"):  # logprobs is validated first (field order)
            raise ValueError("requires logprobs to be true")
        return v

    def logprob_count(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    @field_validator("function_call")
    @classmethod
    def _function_call(cls, v):
        if v not in (None, "none", "auto"):
            raise ValueError("function_call is not supported by this server")
        return v

    @field_validator("modalities")
    @classmethod
    def _modalities(cls, v):
        if v is not None and any(m != "text" for m in v):
            raise ValueError("only the 'text' modality is supported")
        return v

    def limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class CompletionRequest(_SamplingRequest):
    prompt: str | list[str] | list[int] | list[list[int]]  # one prompt, or a batch of them (choices per prompt)
    echo: bool = False
    logprobs: int | None = Field(default=None, ge=0, le=5)  # the legacy API's limit
    suffix: str | None = None  # fill in the middle (code models with FIM tokens; tokenizer/fim.py)
    best_of: int | None = None

    @field_validator("prompt")
    @classmethod
    def _prompts(cls, v):
        """A text, a token-id list, or a batch of either (a one-element text batch is that text)."""
        if isinstance(v, list) and not v:
            raise ValueError("prompt must not be empty")
        if isinstance(v, list) and all(isinstance(x, (str, list)) for x in v):
            for x in v:
                _check_one_prompt(x)
            return v[0] if len(v) == 1 and isinstance(v[0], str) else v
        _check_one_prompt(v)
        return v

    def prompts(self) -> list[str | list[int]]:
        """The request's prompts (choices are per prompt, `n` each)."""
        batch = isinstance(self.prompt, list) and all(isinstance(x, (str, list)) for x in self.prompt)
        return list(self.prompt) if batch else [self.prompt]

    @model_validator(mode="after")
    def _sequences_in_range(self):
        count = len(self.prompts()) * self.n
        if count > MAX_SEQUENCES:
            raise ValueError(f"prompts x n must be at most {MAX_SEQUENCES} (sequences per request), got {count}")
        return self

    _completion_json_bools = field_validator("echo", mode="before")(_json_bool)
    _completion_json_numbers = field_validator("best_of", "logprobs", mode="before")(_json_number)

    @model_validator(mode="after")
    def _suffix_with_text(self):
        if self.suffix is not None and not all(isinstance(p, str) for p in self.prompts()):
            raise ValueError("suffix goes with text prompts (the text before the gap), not token ids")
        return self

    def logprob_count(self) -> int | None:
        return self.logprobs

    @field_validator("best_of")
    @classmethod
    def _best_of(cls, v):
        if v not in (None, 1):
            raise ValueError("only best_of=1 is supported")
        return v

    def limit(self) -> int | None:
        return self.max_tokens


class TokenizeRequest(_Strict):
    """POST /tokenize (vLLM's route): a text (with the model's BOS rule unless add_special_tokens is false) or chat
    messages as a chat completion would render them."""

    _json_bools = field_validator("add_special_tokens", "add_generation_prompt", "continue_final_message",
                                  mode="before")(_json_bool)

    model: str | None = None
    prompt: str | None = Field(default=None, min_length=1)
    messages: list[ChatMessage] | None = Field(default=None, min_length=1)
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    tools: list[ToolDef] | None = Field(default=None, max_length=MAX_TOOLS)
    chat_template_kwargs: dict[str, Any] | None = None
    _chat_template_kwargs = field_validator("chat_template_kwargs")(_template_kwargs)

    @model_validator(mode="after")
    def _one_source(self):
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of prompt and messages")
        check_continue(self.add_generation_prompt, self.continue_final_message)
        return self

    def sequence_fields(self) -> dict:
        """SequenceRequest fields of the same prompt."""
        if self.prompt is not None:
            return {"prompt": self.prompt}
        return chat_prompt_fields(self.messages, self.tools, self.add_generation_prompt, self.continue_final_message,
                                  self.chat_template_kwargs)


class DetokenizeRequest(_Strict):
    model: str | None = None
    tokens: list[int] = Field(min_length=1)

    @field_validator("tokens", mode="before")
    @classmethod
    def _ids(cls, v):
        if not isinstance(v, list) or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in v):
            raise ValueError("must be a list of token ids (integers >= 0)")
        return v


def _check_one_prompt(p) -> None:
    if isinstance(p, str):
        if not p:
            raise ValueError("prompt must not be empty")
    elif not p or not all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in p):
        raise ValueError("a token-id prompt must be a non-empty list of non-negative integers")


# --- responses ----------------------------------------------------------------------------------------------


class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "exl2_backend"
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorBody(BaseModel):
    message: str
    type: str = "invalid_request_error"
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorBody


# --- validation helpers -------------------------------------------------------------------------------------


def first_error(exc: ValidationError) -> tuple[str, str]:
    """(param, message) of a pydantic error, OpenAI style: "messages.0.content: ..."."""
    err = exc.errors()[0]
    loc = [str(p) for p in err.get("loc", ()) if not str(p).startswith(("function-", "union["))]
    # pydantic appends the tried union member (str, list[...]) to loc; keep the field path only
    loc = [p for p in loc if p not in ("str", "int", "list[str]", "list[int]", "list[TextPart]")]
    param = ".".join(loc) or "body"
    kind = err.get("type", "")
    msg = err.get("msg", "invalid value")
    if kind == "extra_forbidden":
        return param, f"Unrecognized request argument supplied: {param}"
    if kind == "missing":
        return param, f"{param}: this field is required"
    msg = msg.removeprefix("Value error, ")
    return param, f"{param}: {msg}"


def lone_surrogate(body, path: str = "") -> tuple[str, str] | None:
    """(param, message) for the first string of a parsed JSON body that is not valid Unicode, or None. JSON may
    escape half of a surrogate pair ("\\ud83d", e.g. an emoji cut by a client's slice); no tokenizer can encode
    it, so it is refused here, as a 400 naming the field, before it reaches the engine."""
    if isinstance(body, str):
        problem = unicode_problem(body)
        return None if problem is None else (path or "body", f"{path or 'body'}: {problem}")
    items = body.items() if isinstance(body, dict) else enumerate(body) if isinstance(body, list) else ()
    for key, value in items:
        found = lone_surrogate(key, path) if isinstance(key, str) else None
        found = found or lone_surrogate(value, f"{path}.{key}" if path else str(key))
        if found:
            return found
    return None

