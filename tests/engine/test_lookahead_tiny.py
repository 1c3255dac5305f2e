"""Decode lookahead on a tiny random EXL2 model on the GPU: tokens equal plain graph decoding, batched with
sequences finishing at different steps and alone, no KV page leaked. test_lookahead.py asks the same of SmolLM2,
whose wheel does not fit a device call's carry; this model is written by the test. A vocabulary of 40,000 puts
the greedy sampler (ops.greedy_tokens) over 20 chunks per row."""

from __future__ import annotations

import pytest
import torch

from tests.helpers.gpu_engine import small_gpu_engine
from tests.helpers.greedy_runs import run_batch, run_greedy_batch

# a stall fails with its stack at 150 s (H200 calls AN1 / AP1: no result from these tests in 90-100 s)
pytestmark = [pytest.mark.cuda, pytest.mark.timeout(150)]


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    eng = small_gpu_engine(tmp_path_factory.mktemp("lookahead") / "m", 40_000, 3, max_seq_len=512, max_batch_size=4)
    assert eng.lookahead is not None
    return eng


def test_the_lookahead_takes_greedy_graphs_by_default(engine, monkeypatch):
    monkeypatch.delenv("EXL2_BACKEND_GRAPH_IO", raising=False)
    from exl2_backend.runtime.lookahead import DecodeLookahead

    assert DecodeLookahead(engine, engine.runner).graphs is not None
    monkeypatch.setenv("EXL2_BACKEND_GRAPH_IO", "0")
    assert DecodeLookahead(engine, engine.runner).graphs is None


@pytest.mark.parametrize("graph_io", [False, True], ids=["plain-graph-steps", "graph-io"])
def test_lookahead_tokens_identical_on_a_tiny_model(engine, graph_io):
    from exl2_backend.runtime.lookahead import DecodeLookahead

    saved = engine.lookahead
    engine.lookahead = DecodeLookahead(engine, engine.runner, graph_io=graph_io)
    try:
        _lookahead_tokens_identical(engine)
    finally:
        engine.lookahead = saved


def _lookahead_tokens_identical(engine):
    g = torch.Generator().manual_seed(1)
    prompts = {sid: torch.randint(3, 39_000, (n,), generator=g).tolist() for sid, n in (("a", 7), ("b", 30),
                                                                                        ("c", 15))}
    lengths = {"a": 40, "b": 25, "c": 33}  # sequences finish at different steps: the batch shrinks
    free0 = engine.pages.available
    want = run_greedy_batch(engine, prompts, lengths, lookahead=False)
    used0 = engine.lookahead.steps_ahead_used
    got = run_greedy_batch(engine, prompts, lengths, lookahead=True)
    assert got == want
    assert engine.lookahead.steps_ahead_used > used0
    assert all(len(got[sid]) == lengths[sid] for sid in prompts)
    alone = run_greedy_batch(engine, {"a": prompts["a"]}, {"a": 40}, lookahead=True)
    assert alone["a"] == run_greedy_batch(engine, {"a": prompts["a"]}, {"a": 40}, lookahead=False)["a"]
    assert engine.pages.available == free0
    engine.assert_no_leaks()


def test_lookahead_with_host_io_in_the_graph(engine):
    """EXL2_BACKEND_GRAPH_IO's path (runtime/greedy_graphs.py): each step one launch of a parity graph that reads
    its staging rows and the previous launch's tokens from pinned memory and writes its greedy tokens there. The
    tokens equal plain graph decoding, batched (the batch shrinks across buckets 4 -> 2 -> 1) and alone."""
    from exl2_backend.runtime.lookahead import DecodeLookahead

    g = torch.Generator().manual_seed(2)
    prompts = {sid: torch.randint(3, 39_000, (n,), generator=g).tolist() for sid, n in (("a", 9), ("b", 21),
                                                                                        ("c", 4))}
    lengths = {"a": 37, "b": 18, "c": 29}
    free0 = engine.pages.available
    want = run_greedy_batch(engine, prompts, lengths, lookahead=False)
    want_alone = run_greedy_batch(engine, {"b": prompts["b"]}, {"b": 18}, lookahead=False)
    saved = engine.lookahead
    engine.lookahead = DecodeLookahead(engine, engine.runner, graph_io=True)
    try:
        got = run_greedy_batch(engine, prompts, lengths, lookahead=True)
        alone = run_greedy_batch(engine, {"b": prompts["b"]}, {"b": 18}, lookahead=True)
        stats = engine.lookahead.steps_ahead_used, engine.lookahead.graphs.launches
        assert engine.stats()["graph_io_launches"] == stats[1] and engine.stats()["graph_io_failed"] is None
    finally:
        engine.lookahead = saved
    assert got == want
    assert alone == want_alone
    assert stats[0] > 0 and stats[1] > stats[0]
    assert engine.pages.available == free0
    engine.assert_no_leaks()


def test_lookahead_falls_back_when_a_greedy_graph_capture_fails(engine, monkeypatch):
    """A failed capture (e.g. pinned memory the device cannot map) is logged once and the plain graph steps run:
    the same tokens, no leaked page, and no later capture is tried."""
    from exl2_backend.runtime.greedy_graphs import GreedyGraphs
    from exl2_backend.runtime.lookahead import DecodeLookahead

    def broken(self, bucket):
        raise RuntimeError("capture failed on purpose")

    g = torch.Generator().manual_seed(3)
    prompts = {"a": torch.randint(3, 39_000, (6,), generator=g).tolist()}
    want = run_greedy_batch(engine, prompts, {"a": 12}, lookahead=False)
    saved = engine.lookahead
    monkeypatch.setattr(GreedyGraphs, "_capture", broken)
    engine.lookahead = DecodeLookahead(engine, engine.runner, graph_io=True)
    try:
        got = run_greedy_batch(engine, prompts, {"a": 12}, lookahead=True)
        graphs = engine.lookahead.graphs
        stats = engine.stats()
    finally:
        engine.lookahead = saved
    assert got == want
    assert graphs.launches == 0 and graphs.failed is not None
    assert stats["graph_io_launches"] == 0 and "on purpose" in stats["graph_io_failed"]
    engine.assert_no_leaks()


@pytest.mark.parametrize("graph_io", [False, True], ids=["plain-graph-steps", "graph-io"])
def test_a_nan_in_one_sequence_fails_it_and_the_batch_goes_on(engine, graph_io):
    """NaN values in one sequence's V cache page (a numerical fault inside the captured step) give that row NaN
    logits; the sampler kernel flags the row (-1), so the lookahead fails that sequence (finish "error", pages
    returned) instead of emitting and feeding back the NaN's index, and the other sequence decodes to its end."""
    from exl2_backend.runtime import GenerationParams
    from exl2_backend.runtime.lookahead import DecodeLookahead
    from exl2_backend.sampling import SamplingParams

    params = GenerationParams(sampling=SamplingParams.greedy(), max_new_tokens=12, ignore_eos=True)
    saved, free0 = engine.lookahead, engine.pages.available
    engine.lookahead = DecodeLookahead(engine, engine.runner, graph_io=graph_io)
    page = None
    try:
        g = torch.Generator().manual_seed(4)
        for sid in ("sick", "well"):
            engine.add_sequence(sid, torch.randint(3, 39_000, (9,), generator=g).tolist(), params)
            engine.prefill([sid])
        events = {"sick": [], "well": []}
        for ev in engine.decode(["sick", "well"]):  # the lookahead now has the next step in flight
            events[ev.seq_id].append(ev)
        page = engine.seqs["sick"].pages[0]
        engine.cache.v[0][page].fill_(float("nan"))  # [page_size, kv_heads, head_dim], after the queued step
        live = ["sick", "well"]
        for _ in range(params.max_new_tokens):  # bounded: "well" finishes within its max_new_tokens
            for ev in engine.decode(live):
                events[ev.seq_id].append(ev)
            live = [sid for sid in live if not engine.seqs[sid].finished]
            if not live:
                break
        used = engine.lookahead.steps_ahead_used
        launches = engine.lookahead.graphs.launches if graph_io else 0
    finally:
        engine.lookahead = saved
        if page is not None:
            engine.cache.v[0][page].zero_()  # the page is free again: no NaN left for the module's other tests
    sick, well = events["sick"][-1], events["well"][-1]
    assert sick.finish_reason == "error" and "NaN logits" in sick.error and not sick.token_ids
    assert len([ev for ev in events["sick"] if ev.token_ids]) <= 2  # the step in flight, at most one more
    assert well.finish_reason == "length" and sum(len(ev.token_ids) for ev in events["well"]) == 11
    assert used > 0 and (launches > 0) == graph_io
    for sid in ("sick", "well"):
        engine.release(sid)
    assert engine.pages.available == free0
    engine.assert_no_leaks()


def test_sequences_asking_for_logprobs_take_the_lookahead(engine):
    """A greedy sequence with logprobs takes plain graph steps (the greedy graphs keep no logits) with its logprobs
    computed on the device behind the token: one entry per token (the most likely token, itself), the same tokens
    and entries as eager decoding, and lookahead steps used."""
    from exl2_backend.runtime import GenerationParams
    from exl2_backend.sampling import SamplingParams

    ids = torch.randint(3, 39_000, (11,), generator=torch.Generator().manual_seed(5)).tolist()
    params = {"a": GenerationParams(sampling=SamplingParams.greedy(), max_new_tokens=9, ignore_eos=True,
                                    logprobs=2)}
    want_lp, got_lp = {}, {}
    want = run_batch(engine, {"a": ids}, params, lookahead=False, logprobs=want_lp)
    used, launches = engine.lookahead.steps_ahead_used, engine.stats()["graph_io_launches"]
    got = run_batch(engine, {"a": ids}, params, lookahead=True, logprobs=got_lp)
    assert got == want and got_lp == want_lp and len(got_lp["a"]) == 8  # the prefill's token has its own
    assert all(x.token_id == t and x.top[0] == (t, x.logprob) and len(x.top) == 2
               for x, t in zip(got_lp["a"], got["a"][1:]))
    assert engine.lookahead.steps_ahead_used > used and engine.stats()["graph_io_launches"] == launches
    engine.assert_no_leaks()


def test_a_biased_greedy_sequence_takes_the_plain_graph_steps(engine):
    """logit_bias changes which token is the argmax, so the greedy graphs (raw argmax on the device) must not run
    such a sequence; the lookahead runs it on plain graph steps with the bias applied by the eager sampler: +100
    on one token gives that token at every step, and lookahead steps are used."""
    from exl2_backend.runtime import GenerationParams
    from exl2_backend.sampling import SamplingParams

    used = engine.lookahead.steps_ahead_used
    launches = engine.stats()["graph_io_launches"]
    engine.add_sequence("b", [5, 6, 7, 8], GenerationParams(sampling=SamplingParams.greedy(), max_new_tokens=6,
                                                            ignore_eos=True, logit_bias={1234: 100}))
    tokens = engine.prefill(["b"])[0].token_ids
    for _ in range(6):  # bounded: 6 tokens in all
        if engine.seqs["b"].finished:
            break
        tokens += engine.decode(["b"])[0].token_ids
    assert tokens == [1234] * 6 and engine.lookahead.steps_ahead_used > used
    assert engine.stats()["graph_io_launches"] == launches
    engine.release("b")
    engine.assert_no_leaks()
