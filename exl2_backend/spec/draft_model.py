"""A small draft model beside the target: its own paged KV cache, page budget and (on CUDA) decode graphs.

For each sequence the draft keeps `num_computed`: how many leading positions of the sequence's committed
tokens have KV in the draft cache. Proposing k tokens first catches the draft up to all but the last
committed token (chunked, eager for long catch-ups such as the prompt), then runs k batched one-token steps
(graph replays on CUDA): the last token -> d1, d1 -> d2, ..., d(k-1) -> dk. After the target verified them,
`rollback` keeps the KV of the accepted drafts and frees the pages past them. Pages are reserved per sequence
for its longest possible run (like the target's), so drafting never runs out of pages mid-sequence.
"""

from __future__ import annotations

import logging
import math
import time

import torch

from exl2_backend import ops
from exl2_backend.ops.reference import make_generator
from exl2_backend.runtime.model_runner import ModelRunner
from exl2_backend.runtime.pages import PageBudget
from exl2_backend.runtime.sampler import penalized_logits
from exl2_backend.runtime.sequence import banned_stops
from exl2_backend.spec.rejection import processed_probs, race

log = logging.getLogger("exl2_backend")


class _DraftSeq:
    """The draft's view of one sequence (PageBudget works on its pages / reserved_pages)."""

    def __init__(self, seq_id: str, seed: int | None):
        self.seq_id = seq_id
        self.pages: list[int] = []
        self.reserved_pages = 0
        self.num_computed = 0
        self.proposal: list[int] = []  # the tokens the last proposal fed and produced (their KV is cached)
        self.proposal_start = 0  # the sequence's num_tokens when it was made
        # Its own stream of uniforms: the target's generator is left to the target's sampling.
        self.generator = make_generator(None if seed is None else (seed + 0x9E3779B97F4A7C15) % (1 << 64))


class _Counts:
    """A sequence's sampling state extended by its drafts so far (what `penalized_logits` reads): the draft
    proposes from the distribution the target will check against, penalties, logit bias and grammar included (its
    own copy of the grammar, ahead of the sequence), so fewer of its drafts are rejected. Verification stays exact
    either way: a sampled draft's distribution goes with it to rejection sampling."""

    def __init__(self, seq):
        self.params = seq.params
        self.prompt_counts = seq.prompt_counts
        self.output_counts = None if seq.output_counts is None else seq.output_counts.clone()
        self.logit_bias = seq.logit_bias  # ids and biases (read only)
        self.grammar = None if seq.grammar is None else seq.grammar.fork()
        self.plain_greedy = seq.plain_greedy
        self._seq, self._generated = seq, len(seq.output_ids)  # tokens out, the drafts so far included

    @property
    def banned(self) -> list[int] | None:
        return banned_stops(self._seq, self._generated)

    def add(self, token: int) -> None:
        self._generated += 1
        if self.output_counts is not None and token < self.output_counts.numel():
            self.output_counts[token] += 1
        if self.grammar is not None and not self.grammar.consume(token):
            self.grammar = None  # a token outside it (a NaN row's): the rest of this proposal goes unconstrained


class DraftModel:
    """Weights are loaded at construction; `allocate` makes the cache once the engine has sized its own."""

    def __init__(self, model, tokenizer, target_vocab: int, cache_type: str = "fp16"):
        self.model = model
        self.cache_type = cache_type  # the target's: the memory plan counts the draft cache at the same type
        self.tokenizer = tokenizer
        self.target_vocab = target_vocab
        self.cache = None
        self.pages: PageBudget | None = None
        self.runner: ModelRunner | None = None
        self.states: dict[str, _DraftSeq] = {}
        self.max_chunk_size = 2048
        self.forward_seconds = 0.0  # wall time of the one-token proposal steps (for the cost model)
        self.forward_steps = 0

    @property
    def kv_bytes_per_token(self) -> int:
        from exl2_backend.cache import kv_bytes_per_token

        m = self.model
        return kv_bytes_per_token(m.num_layers, m.num_kv_heads, m.head_dim, m.dtype, self.cache_type)

    def allocate(self, num_pages: int, page_size: int, max_seq_len: int, max_batch_size: int, max_chunk_size: int,
                 use_cuda_graphs: bool) -> None:
        """The draft's KV cache (same pages and page size as the target's) and its runner."""
        self.cache = self.model.make_cache(num_pages, page_size, cache_type=self.cache_type)
        self.pages = PageBudget(num_pages, page_size)
        self.max_chunk_size = max_chunk_size
        max_pages = math.ceil(max_seq_len / page_size)
        self.runner = ModelRunner(self.model, self.cache, max_pages)
        if self.model.device.type == "cuda" and use_cuda_graphs and ops.cuda_enabled():
            from exl2_backend.runtime.cuda_graphs import CudaGraphRunner

            try:
                runner = CudaGraphRunner(self.model, self.cache, max_pages, max_batch_size)
                runner.capture_all()
                self.runner = runner
            except Exception as exc:  # noqa: BLE001 - eager drafting is a correct fallback
                log.warning("exl2_backend: draft model CUDA-graph capture failed (%s); drafting eagerly", exc)

    # --- per-sequence state ------------------------------------------------------------------------------

    def _state(self, seq) -> _DraftSeq | None:
        """The sequence's draft state, reserving its pages on first use; None when the draft cache is full."""
        st = self.states.get(seq.seq_id)
        if st is None:
            need = self.pages.pages_for(seq.max_total)
            if need > self.pages.available:
                return None
            st = _DraftSeq(seq.seq_id, seq.params.sampling.seed)
            self.pages.reserve(st, need)
            self.states[seq.seq_id] = st
        return st

    def forget(self, seq_id: str) -> None:
        """Free a sequence's draft pages and reservation (it finished or was released)."""
        st = self.states.pop(seq_id, None)
        if st is not None:
            self.pages.release(st)

    def rollback(self, seq) -> None:
        """After verification: keep the draft KV of tokens the sequence committed (the prefix of the last
        proposal that the target kept: drafts the verify clipped or padded over do not count), free the pages
        past it."""
        st = self.states.get(seq.seq_id)
        if st is None:
            return
        new = seq.tokens[st.proposal_start :]
        a = 0
        while a < min(len(st.proposal), len(new)) and st.proposal[a] == new[a]:
            a += 1
        st.num_computed = min(st.num_computed, st.proposal_start + a, seq.num_tokens - 1)
        st.proposal, st.proposal_start = [], 0
        self.pages.shrink(st, st.num_computed)

    def check(self) -> None:
        """Page invariant of the draft cache (tests)."""
        self.pages.check(list(self.states.values()))

    # --- proposing ---------------------------------------------------------------------------------------

    def _logits_to_target_vocab(self, logits: torch.Tensor) -> torch.Tensor:
        """[B, Vd] -> [B, Vt]: ids the target lacks are cut, ids the draft lacks can never be proposed."""
        v = self.target_vocab
        if logits.shape[1] >= v:
            return logits[:, :v]
        pad = logits.new_full((logits.shape[0], v - logits.shape[1]), float("-inf"))
        return torch.cat([logits, pad], dim=1)

    def _catch_up(self, seqs, states) -> None:
        """Compute the draft KV of every committed token but the last (which the first proposal step feeds)."""
        for _ in range(1 + max(s.num_tokens for s in seqs) // max(self.max_chunk_size, 1)):
            groups: dict[int, list[tuple]] = {}
            for s, st in zip(seqs, states):
                n = min(s.num_tokens - 1 - st.num_computed, self.max_chunk_size)
                if n > 0:
                    groups.setdefault(n, []).append((s, st))
            if not groups:
                return
            for n, group in groups.items():
                for s, st in group:
                    self.pages.grow(st, st.num_computed + n)
                toks = [s.tokens[st.num_computed : st.num_computed + n] for s, st in group]
                self.runner.run(toks, [st.num_computed for _, st in group], [st.pages for _, st in group])
                for _, st in group:
                    st.num_computed += n

    def propose(self, seqs, k: int) -> tuple[dict[str, list[int]], dict[str, list[torch.Tensor | None]]]:
        """k draft tokens per sequence (those whose draft cache is full get none) and, per token, the
        distribution it was drawn from ([Vt] f32, or None for greedy sequences: argmax, a deterministic
        proposal)."""
        pairs = [(s, st) for s in seqs if (st := self._state(s)) is not None]
        if not pairs or k <= 0:
            return {}, {}
        seqs, states = [p[0] for p in pairs], [p[1] for p in pairs]
        self._catch_up(seqs, states)
        starts = [s.num_tokens - 1 for s in seqs]  # position of each sequence's last committed token
        inputs = [s.last_token for s in seqs]
        counts = [_Counts(s) for s in seqs]
        sampled = [i for i, s in enumerate(seqs) if s.params.sampling.temperature != 0]
        drafts: dict[str, list[int]] = {s.seq_id: [] for s in seqs}
        probs: dict[str, list[torch.Tensor | None]] = {s.seq_id: [] for s in seqs}
        t0 = time.perf_counter()
        for j in range(k):
            for st, p in zip(states, starts):
                self.pages.grow(st, p + j + 1)
            logits = self.runner.run([[t] for t in inputs], [p + j for p in starts], [st.pages for st in states])
            logits = self._logits_to_target_vocab(logits.float())  # [B, Vt]
            tokens = torch.argmax(logits, dim=-1)  # [B]; greedy rows
            shaped = [i for i, c in enumerate(counts) if not c.plain_greedy and i not in sampled]
            if shaped:  # greedy rows with penalties, a bias or a grammar: the argmax the target's check takes
                tokens[shaped] = torch.argmax(penalized_logits([counts[i] for i in shaped], logits[shaped]), dim=-1)
            q = None
            if sampled:
                q = processed_probs([counts[i] for i in sampled], logits[sampled])  # [b', Vt]
                tokens[sampled] = race(q, [states[i].generator for i in sampled])
            inputs = tokens.tolist()
            for i, s in enumerate(seqs):
                drafts[s.seq_id].append(inputs[i])
                counts[i].add(inputs[i])
            for row, i in enumerate(sampled):
                probs[seqs[i].seq_id].append(q[row])
            for i, s in enumerate(seqs):
                if s.params.sampling.temperature == 0:
                    probs[s.seq_id].append(None)
            for st, p in zip(states, starts):
                st.num_computed = p + j + 1
        self.forward_seconds += time.perf_counter() - t0
        self.forward_steps += k
        for s, st in zip(seqs, states):
            st.proposal, st.proposal_start = drafts[s.seq_id], s.num_tokens
        return drafts, probs
