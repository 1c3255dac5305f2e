"""`Engine`: the step-level API the host hooks wrap (decision 7): admit sequences, prefill their prompts in
chunks, decode them in batches, verify host-supplied drafts, release them. No scheduler: the host decides
which sequences step together.

KV pages (runtime/pages.py): at admission a sequence reserves the pages its longest possible run needs
(prompt + max_new_tokens, capped at max_seq_len) and allocates them lazily as it grows, so a running
sequence never fails for lack of pages. Every exit (finish, error, release) returns pages and reservation.
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Callable

import torch

from exl2_backend import ops
from exl2_backend.cache import kv_bytes_per_token
from exl2_backend.cache.prefix import NO_MATCH
from exl2_backend.errors import CapacityError, InvalidRequestError, PromptTooLongError
from exl2_backend.runtime.logprobs import TokenLogprob, token_logprobs
from exl2_backend.runtime.lookahead import DecodeLookahead
from exl2_backend.runtime.model_runner import ModelRunner
from exl2_backend.runtime.pages import PageBudget
from exl2_backend.runtime.params import GenerationParams, StepEvent
from exl2_backend.runtime.sampler import NAN_LOGITS, sample_for
from exl2_backend.runtime.sequence import Sequence
from exl2_backend.runtime.settings import LoadSettings
from exl2_backend.tokenizer import StopMatcher

log = logging.getLogger("exl2_backend")

PROMPT_LOGITS_BYTES = 64 << 20  # f32 logits one prompt-scoring chunk may hold (prompt_logprobs)


def _notify(callback: Callable[[], None]) -> None:
    """Run a host's step callback; its failure is the host's problem, never the sequences' (logged)."""
    try:
        callback()
    except Exception:
        log.exception("exl2_backend: a host's on_launched callback failed")


class _NoDecoder:
    """Stands in for a tokenizer's incremental decoder when the engine has no tokenizer (tests)."""

    def push(self, token_id: int) -> str:
        return ""


class Engine:
    """Model + paged KV cache + sequences. Build with `Engine.load(settings)` or `Engine(model, tokenizer,
    settings)` (tokenizer may be None: no text, no stop strings)."""

    def __init__(self, model, tokenizer, settings: LoadSettings | None = None):
        self.model = model
        self.tokenizer = tokenizer
        self.config = model.config
        self.device = model.device
        draft = None
        if settings is not None and settings.draft_model is not None:  # loaded and checked before cache sizing
            from exl2_backend.spec.loader import load_draft

            draft = load_draft(model, tokenizer, settings)
        free = torch.cuda.mem_get_info(self.device)[0] if self.device.type == "cuda" else None
        cache_type = settings.cache_type if settings is not None else "fp16"
        bpt = kv_bytes_per_token(model.num_layers, model.num_kv_heads, model.head_dim, model.dtype, cache_type)
        bpt += draft.kv_bytes_per_token if draft is not None else 0  # the draft's cache holds as many tokens
        self.settings = (settings or LoadSettings()).resolve(self.config, bpt, free)
        s = self.settings
        self.page_size = s.page_size
        self.max_seq_len = s.max_seq_len
        self.num_pages = math.ceil(s.cache_tokens / s.page_size)
        self.cache = model.make_cache(self.num_pages, s.page_size, cache_type=s.cache_type)
        self.pages = PageBudget(self.num_pages, s.page_size, prefix_caching=s.prefix_caching,
                                copy_pages=self.cache.copy_pages)
        self.runner = self._make_runner(math.ceil(s.max_seq_len / s.page_size))
        self.spec = None  # speculative decoding (exl2_backend/spec/): decode steps draft and verify
        if s.speculative:
            from exl2_backend.spec.decoder import SpecDecoder

            self.spec = SpecDecoder(self, draft)
        self.eos_ids = set(self.config.eos_token_ids or ())
        if tokenizer is not None:
            self.eos_ids |= set(getattr(tokenizer, "eos_token_ids", ()) or ())
        self.seqs: dict[str, Sequence] = {}
        self._vocabulary = None  # token bytes for grammars and logprobs, built on first use
        self._vocabulary_error: str | None = None  # why llguidance could not read the tokenizer
        self._tokens_generated = 0
        # CUDA-graph decode keeps the next step in flight (runtime/lookahead.py); EXL2_BACKEND_LOOKAHEAD=0 off
        self.lookahead = None
        if os.environ.get("EXL2_BACKEND_LOOKAHEAD", "1") != "0" and DecodeLookahead.supports(self.runner):
            self.lookahead = DecodeLookahead(self, self.runner)

    def _make_runner(self, max_pages: int) -> ModelRunner:
        """CUDA-graph decode (decision 3) when on a GPU with the kernel library and use_cuda_graphs; eager
        otherwise, and also when capture fails (logged once: slower, same results)."""
        s = self.settings
        make = getattr(self.model, "make_runner", None)
        if make is not None:  # layer-split and tensor-parallel models bring their own runner
            return make(self.cache, max_pages, s)
        if self.device.type == "cuda" and s.use_cuda_graphs and ops.cuda_enabled():
            from exl2_backend.runtime.cuda_graphs import CudaGraphRunner

            try:
                runner = CudaGraphRunner(self.model, self.cache, max_pages, s.max_batch_size)
                runner.capture_all()
                return runner
            except Exception as exc:  # noqa: BLE001 - eager decode is a correct fallback
                log.warning("exl2_backend: CUDA-graph capture failed (%s); decoding eagerly", exc)
        return ModelRunner(self.model, self.cache, max_pages)

    @classmethod
    def load(cls, settings: LoadSettings) -> Engine:
        """Load the model and tokenizer of `settings.model_dir` onto `settings.device`."""
        from exl2_backend.runtime.placement import load_model
        from exl2_backend.tokenizer import Tokenizer

        if settings.model_dir is None:
            raise InvalidRequestError("LoadSettings.model_dir is required to load a model", field="model_dir")
        # memory plan first (VramPlanError before anything is allocated), then one device, a layer split or
        # tensor-parallel ranks (runtime/placement.py)
        model, settings = load_model(settings)
        return cls(model, Tokenizer.from_dir(settings.model_dir), settings)

    def close(self) -> None:
        """Stop what the model runs besides this process (tensor-parallel ranks); idempotent."""
        close = getattr(self.model, "close", None)
        if close is not None:
            close()

    # --- admission ---------------------------------------------------------------------------------------

    def _num_active(self) -> int:
        return sum(not s.finished for s in self.seqs.values())

    def free_tokens(self) -> int:
        """Tokens of KV cache neither allocated nor reserved."""
        return self.pages.available * self.page_size

    def can_admit(self, num_tokens: int, prompt_ids: list[int] | None = None) -> bool:
        """Whether a sequence of up to `num_tokens` (prompt + max_new_tokens) would be admitted now. Without
        `prompt_ids` the answer ignores prefix-cache hits (which only lower the cost)."""
        total = min(num_tokens, self.max_seq_len)
        match = self.pages.match(list(prompt_ids or ()))
        need = self.pages.admission_cost(match, total)
        return self._num_active() < self.settings.max_batch_size and need <= self.pages.available

    def add_sequence(self, seq_id: str, prompt_ids: list[int], params: GenerationParams | None = None) -> None:
        """Admit a sequence; its prompt runs on the next `prefill` calls."""
        params = params or GenerationParams()
        if seq_id in self.seqs:
            raise InvalidRequestError(f"sequence id {seq_id!r} is already in use; release it first", field="seq_id")
        prompt = [int(t) for t in prompt_ids]
        n = len(prompt)
        if n == 0:
            raise InvalidRequestError("prompt is empty; give at least one token", field="prompt")
        bad = [t for t in prompt if not 0 <= t < self.model.vocab_size]
        if bad:
            raise InvalidRequestError(f"prompt token id {bad[0]} is outside the vocabulary [0, "
                                      f"{self.model.vocab_size})", field="prompt")
        bad = [t for t in (params.logit_bias or ()) if t >= self.model.vocab_size]
        if bad:
            raise InvalidRequestError(f"logit_bias token id {bad[0]} is outside the vocabulary [0, "
                                      f"{self.model.vocab_size})", field="logit_bias")
        bad = [t for t in params.stop_token_ids if not 0 <= t < self.model.vocab_size]
        if bad:  # it could never be sampled: a silent no-op otherwise
            raise InvalidRequestError(f"stop token id {bad[0]} is outside the vocabulary [0, "
                                      f"{self.model.vocab_size})", field="stop_token_ids")
        grammar = self._grammar_for(params.grammar) if params.grammar is not None else None
        if n >= self.max_seq_len:
            raise PromptTooLongError(f"prompt has {n} tokens but the engine was loaded with max_seq_len="
                                     f"{self.max_seq_len} (prompt + output); shorten the prompt or load with a "
                                     "larger max_seq_len", limit=self.max_seq_len, length=n)
        max_total = min(n + (params.max_new_tokens or self.max_seq_len), self.max_seq_len)
        if self._num_active() >= self.settings.max_batch_size:
            raise CapacityError(f"{self._num_active()} sequences are running (max_batch_size="
                                f"{self.settings.max_batch_size}); retry after one finishes")
        # cached prefix pages (prefix caching); prompt logprobs need every prompt position computed
        match = self.pages.match(prompt) if params.prompt_logprobs is None else NO_MATCH
        need = self.pages.admission_cost(match, max_total)
        if need > self.pages.available:
            raise CapacityError(f"KV cache full: this sequence needs {need * self.page_size} tokens of cache, "
                                f"{self.free_tokens()} are free; retry later or lower max_new_tokens")
        tok = self.tokenizer
        decoder = tok.incremental_decoder() if tok is not None else _NoDecoder()
        seq = Sequence(seq_id, prompt, params, max_total=max_total, vocab_size=self.model.vocab_size,
                       eos_ids=self.eos_ids, decoder=decoder, stop_matcher=StopMatcher(params.stop), grammar=grammar,
                       device=self.device)
        seq.num_computed = seq.cached_tokens = self.pages.admit(seq, prompt, match, max_total)
        self.seqs[seq_id] = seq

    def vocabulary(self):
        """The vocabulary's token bytes as llguidance reads them (grammar/vocabulary.Vocabulary), built on first
        use (~0.3 s for 49k tokens): grammars and the exact bytes of logprob tokens. None without a tokenizer, or
        when llguidance cannot read this one (logged once; grammars are then refused, logprob bytes come from the
        tokens' text)."""
        if self._vocabulary is None and self.tokenizer is not None and self._vocabulary_error is None:
            from exl2_backend.grammar.vocabulary import Vocabulary

            try:
                self._vocabulary = Vocabulary(self.tokenizer, self.model.vocab_size, self.eos_ids)
            except Exception as exc:  # noqa: BLE001 - the model still serves everything else
                self._vocabulary_error = f"{type(exc).__name__}: {exc}"
                log.warning("exl2_backend: llguidance cannot read this tokenizer (%s); grammars are unavailable",
                            self._vocabulary_error)
        return self._vocabulary

    def _grammar_for(self, spec: dict):
        """A fresh SequenceGrammar of a request's grammar (exl2_backend/grammar/); InvalidRequestError(field=
        "grammar") when it does not compile or the engine has no tokenizer."""
        if self.tokenizer is None:
            raise InvalidRequestError("a grammar needs the model's tokenizer; this engine has none", field="grammar")
        vocabulary = self.vocabulary()
        if vocabulary is None:
            raise InvalidRequestError(f"grammars are unavailable for this model's tokenizer ({self._vocabulary_error})",
                                      field="grammar")
        return vocabulary.matcher(spec)

    # --- exits -----------------------------------------------------------------------------------------

    def _finish(self, seq: Sequence, reason: str, error: str | None = None) -> None:
        seq.finish_reason = reason
        seq.error = error or seq.error  # append_token may have said why already
        if self.spec is not None:
            self.spec.forget(seq.seq_id)
        self.pages.release(seq, cache=reason != "error")  # a failed step may have left bad KV: do not cache it

    def _fail(self, seqs: list[Sequence], exc: BaseException) -> list[StepEvent]:
        log.exception("exl2_backend: step failed for %s", [s.seq_id for s in seqs], exc_info=exc)
        for s in seqs:
            if not s.finished:
                self._finish(s, "error", f"{type(exc).__name__}: {exc}")
        return [s.event([], "") for s in seqs]

    # --- steps -------------------------------------------------------------------------------------------

    def _lookup(self, seq_ids, *, prefilled: bool) -> list[Sequence]:
        if len(set(seq_ids)) != len(seq_ids):
            raise InvalidRequestError("a sequence id appears twice in one step", field="seq_ids")
        out = []
        for sid in seq_ids:
            seq = self.seqs.get(sid)
            if seq is None:
                raise InvalidRequestError(f"unknown sequence id {sid!r}", field="seq_ids")
            if seq.finished:
                why = f"{seq.finish_reason}: {seq.error}" if seq.error else seq.finish_reason  # a failed one says why
                raise InvalidRequestError(f"sequence {sid!r} has finished ({why})", field="seq_ids")
            if prefilled and seq.prefill_remaining:
                raise InvalidRequestError(f"sequence {sid!r} has {seq.prefill_remaining} prompt tokens left; "
                                          "call prefill until it returns the first token", field="seq_ids")
            if not prefilled and not seq.prefill_remaining:
                raise InvalidRequestError(f"sequence {sid!r} is already prefilled; call decode", field="seq_ids")
            out.append(seq)
        return out

    def _emit(self, seq: Sequence, tokens: list[int], logprobs: list | None = None) -> StepEvent:
        """Append sampled tokens (stopping at the first finish) and build the event (with the tokens'
        TokenLogprobs when the sequence asked for them)."""
        taken, text = [], ""
        for t in tokens:
            delta, reason = seq.append_token(t)
            taken.append(t)
            text += delta
            if reason is not None:
                self._finish(seq, reason)
                break
        self._tokens_generated += len(taken)
        return seq.event(taken, text, logprobs)

    @staticmethod
    def _logprobs_for(seqs: list[Sequence], logits: torch.Tensor, tokens: list[int]) -> dict[int, TokenLogprob]:
        """Row index -> TokenLogprob of the sampled token, for the rows (logits [B, V]) whose sequence asked
        (GenerationParams.logprobs) and whose row was not a NaN row (that sequence fails)."""
        rows = [i for i, (s, t) in enumerate(zip(seqs, tokens)) if s.params.logprobs is not None and t != NAN_LOGITS]
        if not rows:
            return {}
        got = token_logprobs(logits[rows], [tokens[i] for i in rows], [seqs[i].params.logprobs for i in rows])
        return dict(zip(rows, got))

    def prefill(self, seq_ids: list[str]) -> list[StepEvent]:
        """Run up to max_chunk_size more prompt tokens of each sequence. A sequence whose prompt completes
        gets its first sampled token in its event; the others get an event with no tokens. One forward
        carries at most max_input_len tokens in all (bounded prefill scratch memory)."""
        seqs = self._lookup(seq_ids, prefilled=False)
        chunk = self.settings.max_chunk_size
        events: dict[str, StepEvent] = {}
        groups: dict[tuple[int, bool], list[Sequence]] = {}  # equal chunk lengths share one forward
        # prompt logprobs take every position's logits: chunks held to PROMPT_LOGITS_BYTES of f32 logits
        scored = max(1, PROMPT_LOGITS_BYTES // (4 * self.model.vocab_size))
        for s in seqs:
            wants = s.params.prompt_logprobs is not None
            groups.setdefault((min(chunk, s.prefill_remaining, scored if wants else chunk), wants), []).append(s)
        for (n, wants), group in groups.items():
            per = max(1, min(self.settings.max_batch_size, self.settings.max_input_len // n))
            for i in range(0, len(group), per):
                for ev in self._prefill_group(group[i : i + per], n, wants):
                    events[ev.seq_id] = ev
        return [events[sid] for sid in seq_ids]

    def _prefill_group(self, group: list[Sequence], n: int, score_prompt: bool = False) -> list[StepEvent]:
        try:
            for s in group:
                self.pages.grow(s, s.num_computed + n)
            logits = self.runner.run([s.prompt_ids[s.num_computed : s.num_computed + n] for s in group],
                                     [s.num_computed for s in group], [s.pages for s in group],
                                     "all" if score_prompt else "last")  # [B, V] or [B, n, V]
            if score_prompt:
                for b, s in enumerate(group):
                    self._score_prompt(s, logits[b])
                logits = logits[:, -1]  # [B, V]: the rows that sample
            for s in group:
                s.num_computed += n
                self.pages.cache_prefix(s)
            done = [i for i, s in enumerate(group) if not s.prefill_remaining]
            tokens = sample_for([group[i] for i in done], logits[done]) if done else []
            lps = self._logprobs_for([group[i] for i in done], logits[done], tokens) if done else {}
        except Exception as exc:  # noqa: BLE001 - reported per sequence, pages returned
            return self._fail(group, exc)
        first = {i: (t, lps.get(r)) for r, (i, t) in enumerate(zip(done, tokens))}
        events = [self._emit_sampled(s, *first[i]) if i in first else s.event([], "") for i, s in enumerate(group)]
        for ev, s in zip(events, group):
            if s.prompt_entries is not None and not s.prefill_remaining:
                ev.prompt_logprobs = s.prompt_entries
        return events

    @staticmethod
    def _score_prompt(s: Sequence, logits: torch.Tensor) -> None:
        """logits [n, V] of the chunk at prompt positions a..a+n-1 (a = s.num_computed): row r predicts prompt
        token a+r+1, so the chunk scores the prompt tokens it predicts, up to the prompt's last one."""
        a = s.num_computed
        rows = min(logits.shape[0], len(s.prompt_ids) - 1 - a)
        if rows > 0:
            s.prompt_entries += token_logprobs(logits[:rows], s.prompt_ids[a + 1 : a + 1 + rows],
                                               [s.params.prompt_logprobs] * rows)

    def _emit_sampled(self, s: Sequence, token: int, logprob: TokenLogprob | None = None) -> StepEvent:
        """The sequence's event for a token from sample_for: NAN_LOGITS fails it (tier 2, pages returned)."""
        if token == NAN_LOGITS:
            if s.grammar is not None and s.grammar.allows_nothing():
                why = f": {s.grammar.error}" if s.grammar.error else ""
                message = f"the request's grammar allows no next token{why}"
            else:
                message = "numerical fault: the model produced NaN logits (or +inf: an overflow) for this sequence"
            log.error("exl2_backend: sequence %s fails: %s", s.seq_id, message)
            self._finish(s, "error", message)
            return s.event([], "")
        return self._emit(s, [token], None if logprob is None else [logprob])

    def decode(self, seq_ids: list[str], on_launched: Callable[[], None] | None = None) -> list[StepEvent]:
        """One new token for each sequence, batched (groups of at most max_batch_size). With speculation
        configured, a step drafts and verifies instead (exl2_backend/spec/): one or more tokens each.

        on_launched: called once, on this thread, when the step's device work is queued and before the engine
        waits for it (on CPU: before the synchronous forward). A host publishes the previous step's results
        there, so its Python runs while the GPU computes instead of delaying the next launch (GIL). Not called
        with speculation on or when the step fails before launching; the host then publishes afterwards."""
        seqs = self._lookup(seq_ids, prefilled=True)
        if self.spec is not None:
            return self.spec.decode(seqs)
        if self.lookahead is not None and self.lookahead.eligible(seqs):
            try:
                return self.lookahead.decode(seqs)
            except Exception as exc:  # noqa: BLE001 - reported per sequence, pages returned
                self.lookahead.drop()
                return self._fail(seqs, exc)
        if self.lookahead is not None:
            self.lookahead.drop()
        events = []
        for i in range(0, len(seqs), self.settings.max_batch_size):
            events += self._decode_group(seqs[i : i + self.settings.max_batch_size], {}, on_launched=on_launched)
            on_launched = None
        return events

    def verify(self, seq_ids: list[str], drafts: dict[str, list[int]],
               draft_probs: dict[str, list[torch.Tensor | None]] | None = None) -> list[StepEvent]:
        """Check host-supplied draft tokens: one forward over [last token, d1..dk] per sequence; drafts are
        accepted while the sampled token equals them (exact-match: greedy output equals plain decoding,
        sampled output keeps the model's distribution), then one more token is sampled. KV of rejected
        positions is rolled back. draft_probs[seq_id][j] (optional, [V] f32): the distribution draft j was
        sampled from; such a draft is accepted by rejection sampling instead (spec/rejection.py)."""
        seqs = self._lookup(seq_ids, prefilled=True)
        if self.lookahead is not None:
            self.lookahead.drop()  # undoes a queued step's generator draws before this step samples
        clipped = {}
        for s in seqs:
            d = [int(t) for t in drafts.get(s.seq_id, [])]
            if any(not 0 <= t < self.model.vocab_size for t in d):
                raise InvalidRequestError(f"draft for {s.seq_id!r} has a token id outside the vocabulary",
                                          field="drafts")
            clipped[s.seq_id] = d[: s.max_drafts]
        groups: dict[int, list[Sequence]] = {}
        for s in seqs:
            groups.setdefault(len(clipped[s.seq_id]), []).append(s)
        events = {}
        for group in groups.values():
            for i in range(0, len(group), self.settings.max_batch_size):
                for ev in self._decode_group(group[i : i + self.settings.max_batch_size], clipped, draft_probs):
                    events[ev.seq_id] = ev
        return [events[sid] for sid in seq_ids]

    def _decode_group(self, group: list[Sequence], drafts: dict[str, list[int]],
                      draft_probs: dict | None = None, *, on_launched=None) -> list[StepEvent]:
        k = len(drafts.get(group[0].seq_id, []))
        try:
            starts = [s.num_tokens - 1 for s in group]  # position of each sequence's last sampled token
            for s, p in zip(group, starts):
                self.pages.grow(s, p + 1 + k)
            inputs = [[s.last_token] + drafts.get(s.seq_id, []) for s in group]
            sync_forward = self.device.type != "cuda"  # eager CPU forward: nothing overlaps, notify before it
            if on_launched is not None and sync_forward:
                _notify(on_launched)
            logits = self.runner.run(inputs, starts, [s.pages for s in group], "all" if k else "last")
            if on_launched is not None and not sync_forward:  # queued on the GPU; sampling below waits for it
                _notify(on_launched)
            if k:
                return [self._accept(s, logits[b], drafts[s.seq_id], (draft_probs or {}).get(s.seq_id))
                        for b, s in enumerate(group)]
            tokens = sample_for(group, logits)
            lps = self._logprobs_for(group, logits, tokens)
            for s in group:
                s.num_computed += 1
            return [self._emit_sampled(s, t, lps.get(b)) for b, (s, t) in enumerate(zip(group, tokens))]
        except Exception as exc:  # noqa: BLE001 - reported per sequence, pages returned
            return self._fail(group, exc)

    def _accept(self, s: Sequence, logits: torch.Tensor, draft: list[int], probs=None) -> StepEvent:
        """logits [k+1, V]: row j predicts the token after draft[:j]. Sample row by row (penalty counts see
        the accepted tokens); stop at the first mismatch or finish."""
        taken, text = [], ""
        # Greedy without penalties: each row's token is its argmax whatever was accepted before (one sync).
        greedy = s.plain_greedy
        argmax = ops.greedy_tokens(logits.float()).tolist() if greedy else None  # [k+1]
        for j in range(len(draft) + 1):
            q = probs[j] if probs is not None and j < len(draft) and s.params.sampling.temperature != 0 else None
            if argmax is not None:
                t = argmax[j]
            elif q is None:
                t = sample_for([s], logits[j : j + 1])[0]
            else:  # a sampled draft with its distribution: rejection sampling keeps the target's distribution
                from exl2_backend.spec.rejection import accept_or_resample

                t = accept_or_resample(s, logits[j : j + 1], draft[j], q)
            if t == NAN_LOGITS:  # fails the sequence, this step's accepted tokens with it
                return self._emit_sampled(s, t)
            s.num_computed += 1
            delta, reason = s.append_token(t)
            taken.append(t)
            text += delta
            if reason is not None:
                self._finish(s, reason)
                break
            if j == len(draft) or t != draft[j]:
                break
        self._tokens_generated += len(taken)
        if not s.finished:
            self.pages.shrink(s, s.num_computed)  # rejected drafts' KV lies past num_computed: drop its pages
        lps = None  # row j gave taken[j]: the rows used, scored in one pass
        if s.params.logprobs is not None:
            lps = token_logprobs(logits[: len(taken)], taken, [s.params.logprobs] * len(taken))
        return s.event(taken, text, lps)

    # --- release and stats -------------------------------------------------------------------------------

    def release(self, seq_id: str) -> StepEvent | None:
        """Forget a sequence and free its pages. Idempotent; a still-running sequence ends as "cancelled"
        (its final event is returned), an unknown or already released id returns None."""
        seq = self.seqs.pop(seq_id, None)
        if seq is None:
            return None
        if seq.finished:
            return None
        self._finish(seq, "cancelled")
        return seq.event([], "")

    def stats(self) -> dict:
        return {
            "device": str(self.device),
            "page_size": self.page_size,
            "total_pages": self.num_pages,
            "free_pages": self.pages.unheld,  # free or evictable (cached, held by no sequence)
            "reserved_pages": self.pages.reserved,
            "free_tokens": self.free_tokens(),
            "max_seq_len": self.max_seq_len,
            "cache_tokens": self.num_pages * self.page_size,
            "cache_type": self.cache.cache_type.name,
            "cache_bytes_per_token": self.cache.bytes_per_token(),
            "sequences": len(self.seqs),
            "running": self._num_active(),
            "tokens_generated": self._tokens_generated,
            **(self.spec.stats() if self.spec is not None else {}),  # acceptance rate, mean accepted length
            **self.pages.prefix_stats(),
            "max_input_len": self.settings.max_input_len,
            "prefill_scratch_bytes": self.prefill_scratch_bytes(),
            "lookahead_steps_used": self.lookahead.steps_ahead_used if self.lookahead is not None else 0,
            "lookahead_steps_dropped": self.lookahead.steps_ahead_dropped if self.lookahead is not None else 0,
            "lookahead_sampled_steps": self.lookahead.sampled_steps if self.lookahead is not None else 0,
            "lookahead_deferred_steps": self.lookahead.deferred_steps if self.lookahead is not None else 0,
            **self._graph_io_stats(),
        }

    def _graph_io_stats(self) -> dict:
        """Whether greedy steps ran with their host I/O in the graph (EXL2_BACKEND_GRAPH_IO): launches, and why a
        capture failed (then plain graph steps ran), so a measurement can tell which path it timed."""
        graphs = self.lookahead.graphs if self.lookahead is not None else None
        return {"graph_io_launches": graphs.launches if graphs is not None else 0,
                "graph_io_failed": graphs.failed if graphs is not None else None}

    def flush_prefix_cache(self) -> int:
        """Forget every cached prefix page (pages held by live sequences stay theirs); returns pages freed."""
        return self.pages.flush_prefix_cache()

    def prefill_scratch_bytes(self) -> int:
        """Planned upper bound of the device memory one prefill forward allocates beyond weights and KV cache
        (max_input_len tokens in all): it does not grow with the prompt (runtime/scratch.py)."""
        if getattr(self, "_scratch_bytes", None) is None:  # settings are fixed: plan once
            from exl2_backend.runtime.scratch import prefill_scratch_bytes

            s = self.settings
            self._scratch_bytes = prefill_scratch_bytes(self.model, s.max_input_len, s.max_chunk_size,
                                                        s.max_batch_size, s.max_seq_len, s.page_size)
        return self._scratch_bytes

    def assert_no_leaks(self) -> None:
        """Page accounting invariant (tests): a page's refcount is its live holders (+1 when prefix-cached);
        the rest are free; reservations add up."""
        self.pages.check(list(self.seqs.values()))
        if self.spec is not None:
            self.spec.check()  # the draft model's cache too
