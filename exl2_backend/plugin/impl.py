"""The exl2_backend hook implementations (entry point `exl2_backend.backends: exl2`).

Wraps the runtime `Engine` step API (add_sequence, prefill, decode, verify, release, stats) behind the
hookspecs. Importing this module is cheap and torch-free: the engine is imported inside `exl2_load`.
Like the engine, a handle is not thread-safe: one host thread drives it (docs/hooks.md).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from exl2_backend._version import HOOK_API_VERSION, __version__
from exl2_backend.errors import ConfigError, Exl2Error, InvalidRequestError
from exl2_backend.grammar.spec import GRAMMAR_TYPES
from exl2_backend.plugin.hookspecs import HOOK_NAMES, hookimpl
from exl2_backend.plugin.types import (
    AdmissionRejected,
    BackendHandle,
    EngineLimits,
    EngineUnhealthy,
    Event,
    SequenceFailed,
    SequenceRequest,
    StepBatch,
    Timings,
    Usage,
    check_seq_ids,
)

log = logging.getLogger("exl2_backend.plugin")

BACKEND_NAME = "exl2"

#: What this backend offers; plugin_manifest.toml states the same facts for hosts that must not import us
#: (tests/unit/test_plugin_contract.py keeps the two in agreement).
CAPABILITIES = {
    "name": "exl2_backend",
    "backend": BACKEND_NAME,
    "version": __version__,
    "hook_api_version": HOOK_API_VERSION,
    "formats": ["exl2"],
    "architectures": ["LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM"],
    "devices": ["cpu", "cuda"],
    "cache_types": ["fp16", "fp8", "q8", "q6", "q4"],
    "attention_backends": ["reference", "cuda"],
    "hooks": list(HOOK_NAMES),
    "capacity_unit": "tokens",
    "draft_verify": "exact-match",
    "speculative_decoding": ["draft_model", "ngram", "adaptive_k"],  # LoadSettings draft_model / ngram / ...
    "speculative_sampling": "rejection",  # sampled draft-model proposals keep the target's distribution
    "stop_strings": True,
    "cancellation": "release",
    "prefix_caching": True,
    "chunked_prefill": True,
    "multi_gpu": ["gpu_split", "autosplit", "tensor_parallel"],  # load settings of the same names
    "logprobs": "raw",  # SequenceRequest.logprobs: log_softmax of the model's logits, up to 20 alternatives
    "grammars": list(GRAMMAR_TYPES),  # SequenceRequest.grammar (API 1.4): constrained output
    "threading": "single-engine-thread",
}

DEFAULT_MODEL_ID = "SmolLM2-135M-Instruct-exl2"  # the name of the embedded default model

#: Seconds a host is told to wait after a "no_capacity" rejection (a guess: a typical sequence's remaining life).
RETRY_AFTER_S = 1.0


@dataclass
class _SeqState:
    prompt_len: int
    prefill_remaining: int
    t_admit: float
    t_first: float | None = None
    accepted: int = 0
    proposed: int = 0


class Exl2Handle(BackendHandle):
    """A loaded engine plus the per-sequence bookkeeping the hooks report (timings, draft counts)."""

    backend = BACKEND_NAME

    def __init__(self, engine, model_id: str):
        self.engine = engine
        self.model_id = model_id
        s = engine.settings
        self.limits = EngineLimits(
            max_seq_len=int(engine.max_seq_len), cache_tokens=int(engine.num_pages * engine.page_size),
            page_size=int(engine.page_size), max_batch_size=int(s.max_batch_size),
            max_chunk_size=int(s.max_chunk_size), vocab_size=int(engine.model.vocab_size), device=str(engine.device))
        self._seqs: dict[str, _SeqState] = {}
        self._fatal: str | None = None
        self._busy = threading.Lock()  # held by the stateful hook calls (_exclusive)

    # --- cheap queries ---------------------------------------------------------------------------------

    def can_admit(self, num_tokens: int) -> bool:
        return self._fatal is None and self.engine.can_admit(int(num_tokens))

    def free_tokens(self) -> int:
        return int(self.engine.free_tokens())

    def tokenize(self, text: str, add_special_tokens: bool = True, *, limit: int | None = None) -> list[int]:
        from exl2_backend.errors import PromptTooLongError

        try:
            return self.engine.tokenizer.encode(text, add_special_tokens=add_special_tokens, limit=limit)
        except PromptTooLongError as exc:  # a huge text costs the engine thread nothing
            raise AdmissionRejected(str(exc), reason="prompt_too_long", field="prompt", limit=limit,
                                    length=exc.length) from exc

    def detokenize(self, token_ids: list[int]) -> str:
        return self.engine.tokenizer.decode(list(token_ids))

    def render_chat(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        return self.engine.tokenizer.apply_chat_template(messages, add_generation_prompt)

    def tool_call_format(self, name: str = "auto") -> dict:
        return self.engine.tokenizer.tool_call_format(name).to_dict()

    def reasoning_tags(self, mode: str = "auto") -> dict | None:
        tags = self.engine.tokenizer.reasoning_tags(mode)
        return None if tags is None else tags.to_dict()

    def tokenize_chat(self, messages: list[dict], add_generation_prompt: bool = True) -> list[int]:
        return self.engine.tokenizer.encode_chat(messages, add_generation_prompt)

    def generation_defaults(self) -> dict:
        return dict(self.engine.config.generation_defaults)

    @property
    def healthy(self) -> bool:
        return self._fatal is None

    # --- admission -------------------------------------------------------------------------------------

    def prompt_ids(self, req: SequenceRequest) -> list[int]:
        from exl2_backend.errors import PromptTooLongError
        from exl2_backend.tokenizer.fim import infill_ids

        tok = self.engine.tokenizer
        limit = self.limits.max_seq_len - 1  # the longest prompt that leaves room for one token
        field = "messages" if req.messages is not None else "prompt"
        try:
            if req.prompt_ids is not None:
                return [int(t) for t in req.prompt_ids]
            if req.prompt is not None and req.suffix is not None:
                return infill_ids(tok, req.prompt, req.suffix, limit=limit)
            if req.prompt is not None:
                return tok.encode(req.prompt, limit=limit)
            extra = dict(req.chat_template_kwargs or {})  # validated: no name the renderer sets itself
            if req.tools is not None:
                extra["tools"] = req.tools
            if req.continue_final_message:
                extra["continue_final_message"] = True
            return tok.encode_chat(req.messages, req.add_generation_prompt, limit=limit, **extra)
        except PromptTooLongError as exc:  # sure to be too long: refused before tokenizing (engine thread)
            raise AdmissionRejected(
                f"{exc}; this model is served with a context of max_seq_len={limit + 1} tokens (prompt + "
                f"completion)", reason="prompt_too_long", field=field, limit=limit + 1, length=exc.length,
                seq_id=req.seq_id) from exc
        except (Exl2Error, TypeError, ValueError) as exc:  # TokenizerError: bad template input, ...
            # whatever one request's text does to the tokenizer fails that request, never the engine
            raise AdmissionRejected(f"{field}: {exc}", reason="invalid_request", field=field,
                                    seq_id=req.seq_id) from exc

    def _admit(self, req: SequenceRequest) -> None:
        from exl2_backend.errors import CapacityError, PromptTooLongError
        from exl2_backend.runtime import GenerationParams
        from exl2_backend.sampling import SamplingParams

        req.validate()
        sid = req.seq_id
        if sid in self._seqs:
            raise AdmissionRejected(f"seq_id {sid!r} is already live; release it first", reason="duplicate_id",
                                    field="seq_id", seq_id=sid)
        ids = self.prompt_ids(req)
        limit = self.limits.max_seq_len
        if len(ids) >= limit:
            raise AdmissionRejected(
                f"the prompt has {len(ids)} tokens but this model is served with a context of max_seq_len={limit} "
                f"tokens (prompt + completion); shorten the prompt to at most {limit - 1} tokens",
                reason="prompt_too_long", field="prompt", limit=limit, length=len(ids), seq_id=sid)
        wanted = len(ids) + (req.max_new_tokens or 0)
        if not req.cap_to_context and wanted > limit:
            raise AdmissionRejected(
                f"this model is served with a context of max_seq_len={limit} tokens, but {wanted} were requested "
                f"({len(ids)} in the prompt, {req.max_new_tokens} in the completion); lower max_tokens to at most "
                f"{limit - len(ids)} or shorten the prompt", reason="prompt_too_long", field="max_tokens",
                limit=limit, length=wanted, seq_id=sid)
        try:
            sampling = SamplingParams(
                temperature=req.temperature, top_k=req.top_k, top_p=req.top_p, min_p=req.min_p,
                repetition_penalty=req.repetition_penalty, frequency_penalty=req.frequency_penalty,
                presence_penalty=req.presence_penalty, seed=req.seed)
            params = GenerationParams(sampling=sampling, max_new_tokens=req.max_new_tokens,
                                      min_new_tokens=req.min_new_tokens, stop=list(req.stop),
                                      stop_token_ids=list(req.stop_token_ids), ignore_eos=req.ignore_eos,
                                      logprobs=req.logprobs, logit_bias=req.logit_bias,
                                      prompt_logprobs=req.prompt_logprobs, grammar=req.grammar)
            self.engine.add_sequence(sid, ids, params)
        except PromptTooLongError as exc:
            raise AdmissionRejected(str(exc), reason="prompt_too_long", field="prompt", limit=exc.limit,
                                    length=exc.length, seq_id=sid) from exc
        except CapacityError as exc:
            raise AdmissionRejected(str(exc), reason="no_capacity", retry_after=RETRY_AFTER_S, seq_id=sid) from exc
        except InvalidRequestError as exc:
            field = exc.field or "request"
            reason = "duplicate_id" if field == "seq_id" else "invalid_request"
            raise AdmissionRejected(f"{field}: {exc}", reason=reason, field=field, seq_id=sid) from exc
        seq = self.engine.seqs.get(sid)  # a cached prompt prefix is not run again (prefix caching)
        remaining = seq.prefill_remaining if seq is not None else len(ids)
        self._seqs[sid] = _SeqState(prompt_len=len(ids), prefill_remaining=remaining, t_admit=time.perf_counter())

    # --- steps -----------------------------------------------------------------------------------------

    def _check(self) -> None:
        if self._fatal is not None:
            raise EngineUnhealthy(f"the engine failed earlier and must be reloaded: {self._fatal}")

    def _call(self, fn, *args):
        """Run one engine step; a host mistake (unknown/finished id) raises InvalidRequestError as is, any
        other escaping exception is fatal (tier 3). Per-sequence failures come back as events (tier 2)."""
        self._check()
        try:
            return fn(*args)
        except InvalidRequestError:
            raise
        except Exception as exc:
            self._fatal = f"{type(exc).__name__}: {exc}"
            log.exception("exl2_backend: engine step failed; the engine is now unhealthy")
            raise EngineUnhealthy(f"engine step failed: {self._fatal}") from exc

    def _event(self, ev, *, draft: list[int] | None = None) -> Event:
        """Engine StepEvent -> hook Event (timings on the final one; finished sequences are forgotten)."""
        sid = ev.seq_id
        st = self._seqs.get(sid)
        now = time.perf_counter()
        accepted = None
        if st is not None:
            if ev.token_ids and st.t_first is None:
                st.t_first = now
            if draft is not None:
                n = 0
                while n < min(len(draft), len(ev.token_ids)) and ev.token_ids[n] == draft[n]:
                    n += 1
                accepted = n if ev.finish_reason else min(n, max(len(ev.token_ids) - 1, 0))
                st.accepted += accepted
                st.proposed += len(draft)
        out = Event(sid, list(ev.token_ids), ev.text, ev.finish_reason,
                    Usage(prompt_tokens=int(ev.prompt_tokens), completion_tokens=int(ev.completion_tokens),
                          cached_tokens=int(ev.cached_tokens)),
                    accepted_drafts=accepted)
        if ev.logprobs is not None or ev.prompt_logprobs is not None:
            from exl2_backend.runtime.logprobs import logprob_entries  # torch: imported once an engine runs

            vocabulary = self.engine.vocabulary()  # exact token bytes, when llguidance reads this tokenizer
            tok, token_bytes = self.engine.tokenizer, vocabulary.token_bytes if vocabulary is not None else None
            if ev.logprobs is not None:
                out.logprobs = logprob_entries(ev.logprobs, tok, token_bytes)
            if ev.prompt_logprobs is not None:
                out.prompt_logprobs = logprob_entries(ev.prompt_logprobs, tok, token_bytes)
        if ev.finish_reason == "error":
            out.error = SequenceFailed(ev.error or "sequence failed", seq_id=sid)
        if ev.finish_reason is not None:
            self.engine.release(sid)  # the engine keeps finished sequences until released
            st = self._seqs.pop(sid, None)
            if st is not None:
                first = st.t_first if st.t_first is not None else now
                decode_s = now - first
                out.timings = Timings(
                    prefill_ms=(first - st.t_admit) * 1e3, decode_ms=decode_s * 1e3, total_ms=(now - st.t_admit) * 1e3,
                    decode_tokens_per_s=(ev.completion_tokens - 1) / decode_s if decode_s > 0 else 0.0,
                    accepted_drafts=st.accepted, proposed_drafts=st.proposed)
        return out

    @contextlib.contextmanager
    def _exclusive(self, what: str):
        """One stateful hook call at a time: two threads stepping one engine corrupt its output silently (the
        contract says one engine thread; this makes a breach a typed error instead)."""
        if not self._busy.acquire(blocking=False):
            raise InvalidRequestError(f"{what}: another hook call is running on this handle; hooks are not "
                                      "thread-safe (call them from one thread, and not from on_launched)",
                                      field="handle")
        try:
            yield
        finally:
            self._busy.release()

    def _batch(self, batch) -> StepBatch:
        if not isinstance(batch, StepBatch):
            raise InvalidRequestError(f"batch must be a StepBatch, got {type(batch).__name__}", field="batch")
        batch.validate()
        self._check()
        return batch

    def prefill(self, batch: StepBatch) -> list[Event]:
        with self._exclusive("exl2_prefill"):
            batch = self._batch(batch)
            both = {r.seq_id for r in batch.new} & set(batch.seq_ids)
            if both:
                raise InvalidRequestError(f"sequence id {min(both)!r} is both new and continuing in one "
                                          "prefill batch", field="seq_ids")
            results: dict[str, Event] = {}
            rejected: dict[int, Event] = {}  # by position in batch.new (an id may repeat there)
            admitted = []
            for i, req in enumerate(batch.new):
                try:
                    self._admit(req)
                    admitted.append(req.seq_id)
                except AdmissionRejected as exc:
                    rejected[i] = Event(req.seq_id, finish_reason="error", error=exc)
            ids = admitted + list(batch.seq_ids)
            if ids:
                chunk = self.limits.max_chunk_size
                try:
                    events = self._call(self.engine.prefill, ids)
                except InvalidRequestError:
                    # a host mistake in seq_ids (unknown, finished, twice): the requests this call admitted are
                    # released, or they would hold pages the host was never told about
                    self._release(admitted)
                    raise
                for ev in events:
                    st = self._seqs.get(ev.seq_id)
                    remaining = 0
                    if st is not None:
                        st.prefill_remaining = 0 if ev.token_ids else max(st.prefill_remaining - chunk, 0)
                        remaining = st.prefill_remaining
                    out = self._event(ev)
                    out.prefill_remaining = 0 if out.finished else remaining
                    results[ev.seq_id] = out
            return ([rejected[i] if i in rejected else results[r.seq_id] for i, r in enumerate(batch.new)]
                    + [results[sid] for sid in batch.seq_ids])

    def decode(self, batch: StepBatch) -> list[Event]:
        with self._exclusive("exl2_decode"):
            ids = list(self._batch(batch).seq_ids)
            if not ids:
                return []
            return [self._event(ev) for ev in self._call(self.engine.decode, ids, batch.on_launched)]

    def draft_verify(self, batch: StepBatch) -> list[Event]:
        with self._exclusive("exl2_draft_verify"):
            ids = self._batch(batch).ids()
            if not ids:
                return []
            drafts = {}
            for sid in ids:
                seq = self.engine.seqs.get(sid)
                d = [int(t) for t in batch.drafts.get(sid, [])]
                # the engine verifies at most seq.max_drafts: count acceptance over the same drafts
                drafts[sid] = d[: seq.max_drafts] if seq is not None else d
            return [self._event(ev, draft=drafts[ev.seq_id])
                    for ev in self._call(self.engine.verify, ids, drafts)]

    def release(self, seq_ids) -> list[Event]:
        check_seq_ids("seq_ids", seq_ids)
        with self._exclusive("exl2_release"):
            return self._release(seq_ids)

    def _release(self, seq_ids) -> list[Event]:
        if self.engine is None:  # unloaded: nothing is live
            return []
        out = []
        for sid in seq_ids:
            ev = self.engine.release(sid)
            if ev is not None:
                out.append(self._event(ev))
            self._seqs.pop(sid, None)
        return out

    def stats(self) -> dict:
        if self.engine is None:
            raise EngineUnhealthy("the engine was unloaded")
        s = dict(self.engine.stats())
        s.update(model_id=self.model_id, live_sequences=len(self._seqs), healthy=self.healthy)
        return s

    def unload(self) -> bool:
        with self._exclusive("exl2_unload"):
            self._release(list(self._seqs))
            engine, self.engine = self.engine, None
            if engine is not None:
                engine.close()  # tensor-parallel ranks stop with the engine
            self._fatal = self._fatal or "unloaded"
            device = getattr(engine, "device", None)
            del engine
            if device is not None and getattr(device, "type", "") == "cuda":
                import torch

                torch.cuda.empty_cache()
            return True


def _load_settings(settings: dict):
    """dict -> runtime LoadSettings; None values mean "default"; errors name the field."""
    import pydantic

    from exl2_backend.runtime import LoadSettings

    values = {k: v for k, v in settings.items() if v is not None}
    try:
        return LoadSettings(**values)
    except pydantic.ValidationError as exc:
        raise ConfigError.from_validation(exc, "load setting ") from None


# --- hook implementations ------------------------------------------------------------------------------------


@hookimpl
def exl2_capabilities() -> dict:
    return {k: (list(v) if isinstance(v, list) else v) for k, v in CAPABILITIES.items()}


@hookimpl
def exl2_load(settings: dict):
    settings = dict(settings or {})
    backend = settings.pop("backend", None)
    if backend not in (None, BACKEND_NAME, "exl2_backend"):
        return None
    model_id = settings.pop("model_id", None)
    if settings.get("model_dir") is None:
        from exl2_backend.default_model import ensure_default_model

        settings["model_dir"] = ensure_default_model()
        model_id = model_id or DEFAULT_MODEL_ID
    load = _load_settings(settings)
    from exl2_backend.runtime import Engine

    t0 = time.perf_counter()
    engine = Engine.load(load)
    engine.vocabulary()  # token bytes for grammars and logprobs (~0.3 s for 49k tokens): now, not mid-serving
    handle = Exl2Handle(engine, model_id or Path(load.model_dir).name)
    log.info("exl2_backend: loaded %s on %s in %.1f s (max_seq_len=%d, cache_tokens=%d)", handle.model_id,
             handle.limits.device, time.perf_counter() - t0, handle.limits.max_seq_len, handle.limits.cache_tokens)
    return handle


def _own(handle) -> bool:
    return isinstance(handle, Exl2Handle)


@hookimpl
def exl2_prefill(handle, batch):
    return handle.prefill(batch) if _own(handle) else None


@hookimpl
def exl2_decode(handle, batch):
    return handle.decode(batch) if _own(handle) else None


@hookimpl
def exl2_draft_verify(handle, batch):
    return handle.draft_verify(batch) if _own(handle) else None


@hookimpl
def exl2_release(handle, seq_ids):
    return handle.release(seq_ids) if _own(handle) else None


@hookimpl
def exl2_stats(handle):
    return handle.stats() if _own(handle) else None


@hookimpl
def exl2_unload(handle):
    return handle.unload() if _own(handle) else None
