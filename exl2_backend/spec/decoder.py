"""The speculative decode step the engine runs instead of a plain decode when speculation is configured.

Per batch of running sequences: draft up to k tokens each (n-gram lookup, the draft model, or both: an
n-gram proposal of the full length wins, otherwise the draft model proposes), pad the proposals to one
length so the batch verifies in ONE target forward, and hand them to `Engine.verify` — the same code path as
host-supplied drafts (the `draft_verify` hook). Deterministic proposals (n-gram, padding, greedy drafts) are
accepted by exact match; sampled draft-model proposals carry their distribution q and are accepted by
rejection sampling (spec/rejection.py). Rejected positions are rolled back in both caches.
"""

from __future__ import annotations

import logging
import time

from exl2_backend.spec.adaptive import KController, StepCosts
from exl2_backend.spec.config import MAX_SPECULATIVE_TOKENS, ngram_config
from exl2_backend.spec.ngram import NgramIndex

log = logging.getLogger("exl2_backend")

_COST_DECAY = 0.9  # of the measured draft-step cost (exponential moving average)


class _SpecSeq:
    def __init__(self, controller: KController, index: NgramIndex | None):
        self.controller = controller
        self.index = index


class SpecDecoder:
    """Owns the drafters, the per-sequence k controllers and the acceptance counters of one engine."""

    def __init__(self, engine, draft=None):
        s = engine.settings
        self.engine = engine
        self.draft = draft
        self.ngram = ngram_config(s.ngram)
        self.k = s.num_speculative_tokens
        self.adaptive = s.adaptive_speculation
        self.k_max = min(2 * self.k, MAX_SPECULATIVE_TOKENS) if self.adaptive else self.k
        self.costs = StepCosts(draft=self._initial_draft_cost() if draft is not None else 0.0)
        self.seqs: dict[str, _SpecSeq] = {}
        self.steps = 0  # sequence-steps through the verify path
        self.draft_steps = 0  # ... of them with at least one real proposal
        self.proposed = 0  # real draft tokens (padding excluded)
        self.accepted = 0
        self.rejections = 0  # steps whose real drafts were not all accepted (the per-token estimate's misses)
        self.emitted = 0  # tokens added by speculative steps (accepted drafts + the target's own)
        if draft is not None:
            draft.allocate(engine.num_pages, engine.page_size, engine.max_seq_len, s.max_batch_size,
                           s.max_chunk_size, s.use_cuda_graphs)
        self._wrap_runner()

    def _initial_draft_cost(self) -> float:
        """Draft step / target step before anything is measured: decode is memory-bound, so the ratio of the
        weight bits each model reads per token (config sizes x quantization bits)."""
        def bits(config) -> float:
            h, i, d = config.hidden_size, config.intermediate_size, config.head_dim
            per_layer = h * d * (2 * config.num_attention_heads + 2 * config.num_key_value_heads) + 3 * h * i
            q = config.quantization or {}
            return (config.num_hidden_layers * per_layer * float(q.get("bits", 16))
                    + config.vocab_size * h * float(q.get("head_bits", 16)))

        ratio = bits(self.draft.model.config) / max(bits(self.engine.config), 1.0)
        return min(max(ratio, 0.02), 1.0)

    def _wrap_runner(self) -> None:
        """On CUDA, replay verify steps from graphs like decode steps (spec/verify_graphs.py)."""
        from exl2_backend.runtime.cuda_graphs import CudaGraphRunner

        if isinstance(self.engine.runner, CudaGraphRunner):
            from exl2_backend.spec.verify_graphs import VerifyGraphRunner

            runner = VerifyGraphRunner(self.engine.runner, self.k_max + 1)
            runner.capture([1], [self.k + 1])  # the single-stream step now; other shapes on first use
            self.engine.runner = runner

    @property
    def mode(self) -> str:
        parts = (["draft_model"] if self.draft is not None else []) + (["ngram"] if self.ngram else [])
        return "+".join(parts)

    # --- per-sequence state ------------------------------------------------------------------------------

    def _seq(self, seq) -> _SpecSeq:
        st = self.seqs.get(seq.seq_id)
        if st is None:
            ctrl = KController(self.k, adaptive=self.adaptive, k_max=self.k_max, costs=self.costs)
            st = _SpecSeq(ctrl, NgramIndex(self.ngram) if self.ngram else None)
            self.seqs[seq.seq_id] = st
        return st

    def forget(self, seq_id: str) -> None:
        """A sequence finished or was released: drop its state and its draft pages."""
        self.seqs.pop(seq_id, None)
        if self.draft is not None:
            self.draft.forget(seq_id)

    # --- the step ----------------------------------------------------------------------------------------

    def decode(self, seqs) -> list:
        """One speculative step for each sequence (groups of at most max_batch_size) -> StepEvents."""
        n = self.engine.settings.max_batch_size
        events = []
        for i in range(0, len(seqs), n):
            events += self._step(seqs[i : i + n])
        return events

    def _propose(self, group, budgets: dict[str, int]):
        """-> (drafts, probs, real lengths): proposals before padding."""
        drafts: dict[str, list[int]] = {}
        probs: dict[str, list] = {}
        if self.ngram:
            for s in group:
                if budgets[s.seq_id] > 0:
                    d = self.seqs[s.seq_id].index.propose(s.tokens, budgets[s.seq_id])
                    if d and s.grammar is not None:  # cut where the grammar refuses: the rest would be rejected
                        d = d[: s.grammar.valid_prefix(d)]
                    if d:
                        drafts[s.seq_id] = d
        if self.draft is not None:
            need = [s for s in group if budgets[s.seq_id] > 0 and len(drafts.get(s.seq_id, ())) < budgets[s.seq_id]]
            if need:
                try:
                    d, q = self.draft.propose(need, max(budgets[s.seq_id] for s in need))
                except Exception:  # a failed draft only costs speed: verify without it
                    log.exception("exl2_backend: draft model step failed; decoding without its proposals")
                    for s in need:
                        self.draft.forget(s.seq_id)
                    d, q = {}, {}
                for sid, toks in d.items():
                    drafts[sid] = toks[: budgets[sid]]
                    probs[sid] = q[sid][: budgets[sid]]
        return drafts, probs

    def _step(self, group) -> list:
        engine = self.engine
        states = [self._seq(s) for s in group]
        budgets = {s.seq_id: max(min(st.controller.next_k(), s.remaining_new_tokens - 1), 0)
                   for s, st in zip(group, states)}
        drafts, probs = self._propose(group, budgets) if any(budgets.values()) else ({}, {})
        real = {sid: len(d) for sid, d in drafts.items()}
        width = max(real.values(), default=0)
        # One verify forward for the batch: pad every proposal to the longest (never past a sequence's own
        # length limit). Padding is a deterministic proposal: accepted only if the target agrees with it.
        for s in group:
            sid = s.seq_id
            n = min(width, s.max_drafts)
            d = drafts.setdefault(sid, [])
            fill = d[-1] if d else s.last_token
            d += [fill] * (n - len(d))
            if sid in probs:
                probs[sid] = list(probs[sid]) + [None] * (n - len(probs[sid]))
        t0 = time.perf_counter()
        events = engine.verify([s.seq_id for s in group], drafts, probs or None)
        verify_s = time.perf_counter() - t0
        for s, st, ev in zip(group, states, events):
            sid = s.seq_id
            d = drafts[sid]
            n = 0
            while n < min(len(d), len(ev.token_ids)) and ev.token_ids[n] == d[n]:
                n += 1
            accepted = min(n, real.get(sid, 0))
            self.steps += 1
            self.emitted += len(ev.token_ids)
            if real.get(sid, 0):
                self.draft_steps += 1
                self.proposed += real[sid]
                self.accepted += accepted
                self.rejections += int(accepted < real[sid])
            st.controller.update(real.get(sid, 0), accepted)
            if self.draft is not None and not ev.finished:
                self.draft.rollback(s)
        self._update_costs(verify_s, width)
        return events

    def _update_costs(self, verify_s: float, width: int) -> None:
        """Measured draft-step cost relative to a target step (verify time without its per-row surcharge)."""
        d = self.draft
        if d is None or not self.adaptive or d.forward_steps == 0 or verify_s <= 0:
            return
        step = d.forward_seconds / d.forward_steps
        d.forward_seconds, d.forward_steps = 0.0, 0
        target = verify_s / (1.0 + self.costs.verify * width)
        ratio = min(max(step / target, 0.0), 4.0)
        self.costs.draft = _COST_DECAY * self.costs.draft + (1 - _COST_DECAY) * ratio

    # --- reporting ---------------------------------------------------------------------------------------

    def stats(self) -> dict:
        ks = [st.controller.k for st in self.seqs.values()]
        return {
            "spec_mode": self.mode,
            "spec_num_speculative_tokens": self.k,
            "spec_adaptive": self.adaptive,
            "spec_current_k": (sum(ks) / len(ks)) if ks else float(self.k),
            "spec_steps": self.steps,
            "spec_proposed_tokens": self.proposed,
            "spec_accepted_tokens": self.accepted,
            "spec_acceptance_rate": self.accepted / self.proposed if self.proposed else 0.0,
            # per-token acceptance probability under the geometric model (adaptive.py): accepted / (accepted +
            # first rejections); drafts after a rejection are never judged
            "spec_alpha": (self.accepted / (self.accepted + self.rejections)
                           if self.accepted + self.rejections else 0.0),
            "spec_mean_accepted_length": self.accepted / self.draft_steps if self.draft_steps else 0.0,
            "spec_tokens_per_step": self.emitted / self.steps if self.steps else 0.0,
            "spec_draft_cost": self.costs.draft,
        }

    def check(self) -> None:
        """Page invariant of the draft cache (tests)."""
        if self.draft is not None:
            self.draft.check()
