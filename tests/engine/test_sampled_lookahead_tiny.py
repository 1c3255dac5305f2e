"""The decode lookahead with sampled sequences on a tiny random EXL2 model on the GPU (runtime/lookahead.py): a
step is sampled one step early through the eager path's own sampler, so seeded tokens equal eager decoding's,
batched with greedy, biased, penalized, min_tokens, logprobs and filtered (top-k / top-p / min-p) rows, across
dropped steps (a release, a batch that changes, a verify step), whose generator draws are undone; a constrained
batch's steps sampled when consumed. No KV page leaks."""

from __future__ import annotations

import pytest
import torch

from exl2_backend.runtime import GenerationParams
from exl2_backend.sampling import SamplingParams
from tests.helpers.gpu_engine import small_gpu_engine
from tests.helpers.greedy_runs import run_batch

pytestmark = [pytest.mark.cuda, pytest.mark.timeout(150)]

VOCAB = 40_000


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    eng = small_gpu_engine(tmp_path_factory.mktemp("sampled_lookahead") / "m", VOCAB, 11, max_seq_len=512,
                           max_batch_size=4)
    assert eng.lookahead is not None
    return eng


def _prompts(seed: int, lengths: dict[str, int]) -> dict[str, list[int]]:
    g = torch.Generator().manual_seed(seed)
    return {sid: torch.randint(3, VOCAB - 1000, (n,), generator=g).tolist() for sid, n in lengths.items()}


def _params(n: int, **sampling) -> GenerationParams:
    bias = sampling.pop("logit_bias", None)
    min_new = sampling.pop("min_new_tokens", 0)
    return GenerationParams(sampling=SamplingParams(**sampling), max_new_tokens=n, ignore_eos=min_new == 0,
                            logit_bias=bias, min_new_tokens=min_new)


def _same_with_and_without(engine, prompts, params, schedule=None) -> dict[str, list[int]]:
    free0 = engine.pages.available
    want = run_batch(engine, prompts, params, lookahead=False, schedule=schedule)
    stats0 = engine.stats()
    got = run_batch(engine, prompts, params, lookahead=True, schedule=schedule)
    stats1 = engine.stats()
    assert got == want
    assert stats1["lookahead_steps_used"] > stats0["lookahead_steps_used"]
    assert stats1["lookahead_sampled_steps"] > stats0["lookahead_sampled_steps"]
    assert engine.pages.available == free0
    engine.assert_no_leaks()
    return stats1


def test_sampled_lookahead_tokens_equal_eager_sampling(engine):
    prompts = _prompts(1, {"t": 7, "f": 30, "g": 15, "b": 11})
    params = {
        "t": _params(40, temperature=0.8, seed=1),  # temperature only: the sampler kernel alone
        "f": _params(25, temperature=1.0, top_k=50, top_p=0.9, seed=2),  # the sort-based filter first
        "g": _params(33, temperature=0.0, logit_bias={1234: 4.0}),  # greedy with a bias: plain graph steps
        "b": _params(30, temperature=0.7, min_p=0.05, seed=3, logit_bias={77: 3.0, 99: -100.0}),
    }
    got = run_batch(engine, prompts, params, lookahead=True)
    assert all(len(got[sid]) == params[sid].max_new_tokens for sid in prompts)
    assert 99 not in got["b"]
    _same_with_and_without(engine, prompts, params)
    alone = {"t": prompts["t"]}
    _same_with_and_without(engine, alone, {"t": params["t"]})


def test_dropped_sampled_steps_give_back_their_draws(engine):
    """A release, and a batch that leaves a sequence out for a step and takes it back: each drops the queued step,
    whose draws are undone, so the next draw is the one eager decoding makes."""
    prompts = _prompts(2, {"x": 9, "y": 21, "z": 4})
    params = {sid: _params(30, temperature=0.9, top_p=0.95, seed=10 + i) for i, sid in enumerate(prompts)}

    def churn(step, eng, live, out):
        if step == 5 and "y" in live:
            eng.release("y")
            return [s for s in live if s != "y"]
        if step in (8, 9) and "z" in live:  # x alone for two steps, then the pair again
            return [s for s in live if s != "z"] if step == 8 else live
        return live

    stats0 = engine.stats()
    _same_with_and_without(engine, prompts, params, schedule=churn)
    assert engine.stats()["lookahead_steps_dropped"] > stats0["lookahead_steps_dropped"]


def test_a_verify_step_after_sampled_lookahead_steps(engine):
    """Engine.verify (the draft_verify hook) samples from the same generators: the queued step is dropped and its
    draws undone first, so verify and the steps after it equal the same calls without the lookahead."""
    prompts = _prompts(3, {"v": 12})
    params = {"v": _params(28, temperature=0.8, seed=5)}

    def verify_at_4(step, eng, live, out):
        if step == 4 and "v" in live:
            ev = eng.verify(["v"], {"v": out["v"][-3:]})[0]  # drafts: a few tokens it sampled before
            out["v"] += ev.token_ids
        return [s for s in live if not eng.seqs[s].finished]

    _same_with_and_without(engine, prompts, params, schedule=verify_at_4)


def test_min_tokens_sequences_take_the_lookahead(engine):
    """While min_tokens bans EOS a step's sampling depends on how many tokens are out: the queued step counts the
    one in flight (penalized_logits' `pending`), so the tokens equal eager decoding's throughout."""
    prompts = _prompts(4, {"m": 10, "n": 6})
    params = {"m": _params(24, temperature=0.9, seed=8, min_new_tokens=6),
              "n": _params(24, temperature=0.0, min_new_tokens=3)}
    _same_with_and_without(engine, prompts, params)


def test_penalized_sequences_take_the_lookahead(engine):
    """Penalty counts read every token out, the one in flight included: the queued step adds it on the device, so
    repetition / frequency / presence penalties (sampled and greedy) give eager decoding's tokens."""
    prompts = _prompts(5, {"r": 8, "q": 14, "s": 5})
    params = {"r": _params(30, temperature=0.8, repetition_penalty=1.3, seed=12),
              "q": _params(26, temperature=0.0, frequency_penalty=0.7, presence_penalty=0.4),
              "s": _params(22, temperature=1.1, top_k=40, repetition_penalty=1.2, frequency_penalty=0.3, seed=13)}
    _same_with_and_without(engine, prompts, params)


def test_sampling_on_the_gpu_never_waits_for_it(engine):
    """sample_on_device with sampled, filtered, penalized and biased rows and a pending token per row runs under
    torch's sync debug mode set to "error": no operation in it waits for the device (which would stall the queued
    step behind the one in flight). The sequences' generators live on the GPU."""
    from exl2_backend.runtime.sampler import sample_on_device

    prompts = _prompts(6, {"u": 5, "w": 7})
    params = {"u": _params(4, temperature=0.8, top_p=0.9, repetition_penalty=1.2, seed=1, logit_bias={5: 2.0}),
              "w": _params(4, temperature=0.0, frequency_penalty=0.5)}
    for sid in prompts:
        engine.add_sequence(sid, prompts[sid], params[sid])
    seqs = [engine.seqs[sid] for sid in prompts]
    assert all(s.generator.device.type == "cuda" for s in seqs)
    logits = torch.randn(2, engine.model.vocab_size, device=engine.device)
    pending = torch.tensor([3, 4], device=engine.device)
    sample_on_device(seqs, logits, pending)  # warm: pinned blocks, the sampler's buffers
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        tokens = sample_on_device(seqs, logits, pending)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert tokens.shape == (2,) and tokens.device.type == "cuda"
    for sid in prompts:
        engine.release(sid)
    engine.assert_no_leaks()


def test_logprobs_of_sampled_and_greedy_rows_in_the_lookahead(engine):
    """Logprobs (raw log_softmax, the token's and the best alternatives') computed on the device behind the queued
    step's tokens equal eager decoding's entries, for sampled and greedy rows in one batch."""
    prompts = _prompts(7, {"k": 9, "l": 13})
    params = {"k": GenerationParams(sampling=SamplingParams(temperature=0.9, top_p=0.95, seed=21), max_new_tokens=20,
                                    ignore_eos=True, logprobs=3),
              "l": GenerationParams(sampling=SamplingParams.greedy(), max_new_tokens=16, ignore_eos=True,
                                    logprobs=0)}
    want_lp, got_lp = {}, {}
    want = run_batch(engine, prompts, params, lookahead=False, logprobs=want_lp)
    used = engine.lookahead.steps_ahead_used
    got = run_batch(engine, prompts, params, lookahead=True, logprobs=got_lp)
    assert got == want and got_lp == want_lp
    assert [len(got_lp[sid]) for sid in ("k", "l")] == [19, 15]
    assert all(len(x.top) == 3 for x in got_lp["k"]) and all(x.top == () for x in got_lp["l"])
    assert engine.lookahead.steps_ahead_used > used
    engine.assert_no_leaks()


def test_constrained_batches_defer_their_sampling(engine):
    """A grammar's mask needs the token before it consumed on the host: a batch holding a constrained sequence
    queues the next forward and samples it when consumed. Tokens equal eager decoding's, greedy and sampled,
    beside an unconstrained row; the constrained replies match their grammars."""
    import re

    permissive = {"type": "regex", "value": "[a-z]+( [a-z]+)*"}
    prompts = _prompts(8, {"c": 9, "d": 6, "e": 12})
    params = {"c": GenerationParams(sampling=SamplingParams(temperature=0.9, seed=31), max_new_tokens=20,
                                    grammar=permissive),
              "d": GenerationParams(sampling=SamplingParams.greedy(), max_new_tokens=18, grammar=permissive),
              "e": _params(22, temperature=0.8, seed=32)}
    stats0 = engine.stats()
    stats1 = _same_with_and_without(engine, prompts, params)
    assert stats1["lookahead_deferred_steps"] > stats0["lookahead_deferred_steps"]
    got = run_batch(engine, prompts, params, lookahead=True)
    for sid in ("c", "d"):
        text = engine.tokenizer.decode([t for t in got[sid] if t not in engine.eos_ids])
        assert re.fullmatch(permissive["value"], text), (sid, text)
    engine.assert_no_leaks()
