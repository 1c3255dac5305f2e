"""Engine step API on a tiny random model (CPU, fp32): cache reuse, batching, chunking, drafts, page accounting,
limits, stop conditions and seeded sampling."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from exl2_backend.errors import CapacityError, InvalidRequestError, PromptTooLongError
from exl2_backend.format.config import ModelConfig
from exl2_backend.format.reader import DenseLinear, LayerWeights, ModelWeights
from exl2_backend.model import LlamaModel
from exl2_backend.runtime import Engine, GenerationParams, LoadSettings
from exl2_backend.runtime.model_runner import ModelRunner
from exl2_backend.sampling import SamplingParams
from tests.helpers.nan_logits import check_nan_row_fails_only_its_sequence

VOCAB = 300
GREEDY = SamplingParams.greedy()


def tiny_model(seed: int = 0, vocab: int = VOCAB, device: str = "cpu") -> LlamaModel:
    """2 layers, hidden 64, GQA 4/2, untied head; random fp16 weights scaled so greedy output is varied."""
    cfg = ModelConfig.from_dict({"architectures": ["LlamaForCausalLM"], "hidden_size": 64, "intermediate_size": 128,
                                     "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
                                     "vocab_size": vocab, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
                                     "max_position_embeddings": 512, "tie_word_embeddings": False})
    g = torch.Generator().manual_seed(seed)

    def w(*shape, scale=None):
        return (torch.randn(*shape, generator=g) * (scale or shape[-1] ** -0.5)).half()

    def lin(key, n, k):
        return DenseLinear(key, w(n, k))

    layers = [LayerWeights(1 + w(64, scale=0.1), 1 + w(64, scale=0.1), lin("q", 64, 64), lin("k", 32, 64),
                           lin("v", 32, 64), lin("o", 64, 64), lin("g", 128, 64), lin("u", 128, 64),
                           lin("d", 64, 128)) for _ in range(2)]
    head = DenseLinear("lm_head", w(vocab, 64, scale=0.3))
    weights = ModelWeights(w(vocab, 64, scale=1.0), 1 + w(64, scale=0.1), layers, head)
    return LlamaModel(cfg, weights, device)


class CharTokenizer:
    """Token t is the letter chr(97 + t % 26); no EOS of its own."""

    eos_token_ids = ()

    class _Dec:
        def push(self, t):
            return chr(97 + t % 26)

    def incremental_decoder(self):
        return self._Dec()


def make_engine(model=None, tokenizer=None, **kw) -> Engine:
    settings = {"page_size": 16, "cache_tokens": 2048, "max_seq_len": 256, "max_chunk_size": 2048}
    settings.update(kw)
    return Engine(model or tiny_model(), tokenizer, LoadSettings(**settings))


@pytest.fixture(scope="module")
def model():
    return tiny_model()


def prompt(n: int, seed: int = 0) -> list[int]:
    return torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def run(engine, seq_ids, prompts, params) -> dict[str, list[int]]:
    """Admit, prefill (repeatedly, for chunking), decode all together until every sequence finished."""
    for sid, p in zip(seq_ids, prompts):
        engine.add_sequence(sid, p, params)
    out = {sid: [] for sid in seq_ids}
    pending, live = list(seq_ids), []
    while pending:
        for ev in engine.prefill(pending):
            out[ev.seq_id] += ev.token_ids
            if ev.token_ids or ev.finish_reason:
                pending.remove(ev.seq_id)
                if not ev.finish_reason:
                    live.append(ev.seq_id)
    while live:
        for ev in engine.decode(live):
            out[ev.seq_id] += ev.token_ids
            if ev.finish_reason:
                live.remove(ev.seq_id)
    for sid in seq_ids:
        engine.release(sid)
    engine.assert_no_leaks()
    return out


def naive_greedy(model, ids: list[int], n: int) -> list[int]:
    """Recompute the whole sequence with a fresh cache for every new token (no cache reuse)."""
    ids = list(ids)
    for _ in range(n):
        pages = -(-len(ids) // 16)
        runner = ModelRunner(model, model.make_cache(pages, 16), pages)
        ids.append(int(runner.run([ids], [0], [list(range(pages))])[0].argmax()))
    return ids[-n:]


def test_greedy_matches_full_recompute(model):
    p = prompt(20)
    got = run(make_engine(model), ["a"], [p], GenerationParams(sampling=GREEDY, max_new_tokens=16))["a"]
    assert got == naive_greedy(model, p, 16)
    assert len(set(got)) > 3  # not a degenerate repetition


def test_batch_invariance(model):
    params = GenerationParams(sampling=GREEDY, max_new_tokens=12)
    prompts = [prompt(3 + 5 * i, seed=i) for i in range(16)]  # lengths 3..78, cross page boundaries
    ids = [f"s{i}" for i in range(16)]
    together = run(make_engine(model), ids, prompts, params)
    for sid, p in zip(ids, prompts):
        alone = run(make_engine(model), [sid], [p], params)[sid]
        assert together[sid] == alone, sid


def test_chunked_prefill_identical(model):
    p = prompt(37, seed=3)
    params = GenerationParams(sampling=GREEDY, max_new_tokens=10)
    whole = run(make_engine(model), ["a"], [p], params)["a"]
    engine = make_engine(model, max_chunk_size=5)
    engine.add_sequence("a", p, params)
    events = [engine.prefill(["a"])[0] for _ in range(8)]  # 37 tokens = 7 chunks of 5 + one of 2
    assert [bool(e.token_ids) for e in events] == [False] * 7 + [True]
    with pytest.raises(InvalidRequestError, match="already prefilled"):
        engine.prefill(["a"])
    engine.release("a")
    assert run(make_engine(model, max_chunk_size=5), ["a"], [p], params)["a"] == whole


def test_verify_accepts_correct_and_rolls_back_wrong(model):
    p = prompt(14, seed=5)
    ref = naive_greedy(model, p, 20)
    engine = make_engine(model)
    engine.add_sequence("a", p, GenerationParams(sampling=GREEDY, max_new_tokens=20))
    out = engine.prefill(["a"])[0].token_ids
    ev = engine.verify(["a"], {"a": ref[1:5]})[0]  # 4 correct drafts -> all accepted + 1 bonus token
    assert ev.token_ids == ref[1:6]
    out += ev.token_ids
    wrong = [(t + 1) % VOCAB for t in ref[6:9]]
    ev = engine.verify(["a"], {"a": [ref[6]] + wrong[1:]})[0]  # first right, then wrong: 1 accepted + fix
    assert ev.token_ids == ref[6:8]
    out += ev.token_ids
    seq = engine.seqs["a"]
    assert seq.num_computed == len(p) + len(out) - 1
    assert len(seq.pages) == -(-seq.num_computed // 16)  # rejected positions' pages returned
    while len(out) < 20:  # alternate plain decode and wrong-draft verify: still exactly greedy
        ev = engine.verify(["a"], {"a": [(ref[len(out)] + 7) % VOCAB] * 3})[0]
        out += ev.token_ids
        if not ev.finish_reason:
            out += engine.decode(["a"])[0].token_ids
    assert out == ref
    engine.release("a")
    engine.assert_no_leaks()
    assert engine.stats()["free_pages"] == engine.stats()["total_pages"]


def test_verify_sampled_equals_plain_sampling(model):
    """Exact-match acceptance draws the same uniforms as plain decoding: seeded output is identical."""
    p = prompt(9, seed=6)
    params = GenerationParams(sampling=SamplingParams(temperature=0.8, top_k=40, seed=11), max_new_tokens=24)
    plain = run(make_engine(model), ["a"], [p], params)["a"]
    engine = make_engine(model)
    engine.add_sequence("a", p, params)
    out = engine.prefill(["a"])[0].token_ids
    while True:
        ev = engine.verify(["a"], {"a": plain[len(out) : len(out) + 3]})[0]  # right drafts (from a rerun)
        out += ev.token_ids
        if ev.finish_reason:
            break
    assert out == plain
    engine.release("a")
    engine.assert_no_leaks()


def test_pages_returned_on_finish_cancel_and_error(model, monkeypatch):
    engine = make_engine(model)
    total = engine.stats()["total_pages"]
    params = GenerationParams(sampling=GREEDY, max_new_tokens=4)
    engine.add_sequence("done", prompt(40), params)
    engine.add_sequence("cancel", prompt(20), GenerationParams(sampling=GREEDY, max_new_tokens=100))
    engine.prefill(["done", "cancel"])
    assert engine.stats()["free_pages"] < total
    while not engine.decode(["done"])[0].finish_reason:
        pass
    ev = engine.release("cancel")
    assert ev.finish_reason == "cancelled" and ev.completion_tokens == 1
    assert engine.release("cancel") is None  # idempotent
    assert engine.release("done") is None  # finished: pages already back
    assert engine.stats()["free_pages"] == total and engine.stats()["reserved_pages"] == 0

    engine.add_sequence("err", prompt(20), params)
    engine.prefill(["err"])

    def boom(*a, **k):
        raise RuntimeError("injected fault")

    monkeypatch.setattr(engine.runner, "run", boom)
    ev = engine.decode(["err"])[0]
    assert ev.finish_reason == "error" and "injected fault" in ev.error
    assert engine.stats()["free_pages"] == total
    engine.add_sequence("err2", prompt(20), params)
    assert engine.prefill(["err2"])[0].finish_reason == "error"
    for sid in ("err", "err2"):
        engine.release(sid)
    engine.assert_no_leaks()
    assert engine.stats()["free_pages"] == total and engine.stats()["sequences"] == 0


@pytest.mark.parametrize("fault", [float("nan"), float("inf")], ids=["nan", "posinf"])
@pytest.mark.parametrize("sampling", [GREEDY, SamplingParams(temperature=0.8, seed=3)])
def test_nan_logits_fail_only_their_sequence(model, monkeypatch, sampling, fault):
    """A row of NaN (or +inf: an fp16 overflow) logits, a numerical fault, fails that sequence (finish "error",
    pages returned) instead of drawing a token from it (the reference sampler's zeroed row gave token 0, every
    step, silently; greedy took the +inf's index); the other sequence of the batch decodes on."""
    check_nan_row_fails_only_its_sequence(make_engine(model), monkeypatch,
                                          GenerationParams(sampling=sampling, max_new_tokens=6),
                                          {"sick": prompt(12, 1), "well": prompt(12, 2)}, fault)


@pytest.mark.parametrize("how", ["greedy", "sampled", "sampled-with-draft-probs"])
def test_nan_logits_in_a_verify_fail_only_their_sequence(model, monkeypatch, how):
    """A verify whose logits hold a NaN in the sick sequence's first row fails that sequence (finish
    "error", pages returned) whichever way its rows are checked: greedy argmax, sampled, or rejection sampling
    against the draft's probabilities (whose race over a NaN row gave token 0); the other sequence goes on."""
    sampling = GREEDY if how == "greedy" else SamplingParams(temperature=0.8, seed=5)
    engine = make_engine(model)
    free = engine.pages.available
    params = GenerationParams(sampling=sampling, max_new_tokens=12, ignore_eos=True)
    for sid, seed in (("sick", 1), ("well", 2)):
        engine.add_sequence(sid, prompt(12, seed), params)
    engine.prefill(["sick", "well"])
    real_run = engine.runner.run

    def nan_in_sick_first_row(*args, **kwargs):
        logits = real_run(*args, **kwargs).clone()  # [B, k + 1, V]
        logits[0, 0, 7] = float("nan")  # sick, the row checked first (random drafts are rejected early)
        return logits

    drafts = {"sick": [3, 4, 5], "well": [6, 7, 8]}
    probs = None
    if how == "sampled-with-draft-probs":
        probs = {sid: [torch.full((VOCAB,), 1.0 / VOCAB)] * 3 for sid in drafts}
    monkeypatch.setattr(engine.runner, "run", nan_in_sick_first_row)
    sick, well = engine.verify(["sick", "well"], drafts, probs)
    monkeypatch.setattr(engine.runner, "run", real_run)
    assert sick.finish_reason == "error" and "NaN logits" in sick.error and not sick.token_ids
    assert well.finish_reason is None and 1 <= len(well.token_ids) <= 4
    engine.release("sick")
    engine.release("well")
    engine.assert_no_leaks()
    assert engine.pages.available == free


def test_limits_and_request_errors(model):
    engine = make_engine(model, max_seq_len=64, cache_tokens=160, max_batch_size=3)  # 10 pages
    with pytest.raises(PromptTooLongError, match="max_seq_len=64") as e:
        engine.add_sequence("long", prompt(65), GenerationParams())
    assert e.value.limit == 64 and e.value.length == 65
    with pytest.raises(InvalidRequestError):
        engine.add_sequence("empty", [], GenerationParams())
    with pytest.raises(InvalidRequestError, match="outside the vocabulary"):
        engine.add_sequence("bad", [VOCAB], GenerationParams())
    big = GenerationParams(sampling=GREEDY, max_new_tokens=40)  # 10 + 40 tokens -> 4 pages of 16
    engine.add_sequence("a", prompt(10), big)
    engine.add_sequence("b", prompt(10), big)
    assert not engine.can_admit(50) and engine.can_admit(16)
    with pytest.raises(CapacityError, match="KV cache full"):
        engine.add_sequence("c", prompt(10), big)
    with pytest.raises(InvalidRequestError, match="already in use"):
        engine.add_sequence("a", prompt(10), big)
    with pytest.raises(InvalidRequestError, match="prompt tokens left"):
        engine.decode(["a"])
    engine.add_sequence("c", prompt(3), GenerationParams(sampling=GREEDY, max_new_tokens=2))
    with pytest.raises(CapacityError, match="max_batch_size"):
        engine.add_sequence("d", prompt(3), GenerationParams(sampling=GREEDY, max_new_tokens=2))
    with pytest.raises(InvalidRequestError, match="unknown"):
        engine.prefill(["zzz"])
    for sid in "abc":
        engine.release(sid)
    engine.assert_no_leaks()
    assert engine.stats()["free_pages"] == engine.stats()["total_pages"]


def test_finish_reasons_and_text(model):
    tok = CharTokenizer()
    p = prompt(12, seed=9)
    ref = naive_greedy(model, p, 12)
    letters = "".join(chr(97 + t % 26) for t in ref)

    # max_new_tokens -> "length"; text is the decoded tokens
    engine = make_engine(model, tokenizer=tok)
    out = _events(engine, p, GenerationParams(sampling=GREEDY, max_new_tokens=12))
    assert out[-1].finish_reason == "length" and "".join(e.text for e in out) == letters
    assert out[-1].completion_tokens == 12 and out[-1].prompt_tokens == 12

    # a single new token finishes in prefill, pages returned at once
    one = make_engine(model, tokenizer=tok)
    one.add_sequence("a", p, GenerationParams(sampling=GREEDY, max_new_tokens=1))
    ev = one.prefill(["a"])[0]
    assert ev.token_ids == ref[:1] and ev.finish_reason == "length"
    assert one.stats()["free_pages"] == one.stats()["total_pages"] and one.stats()["reserved_pages"] == 0
    with pytest.raises(InvalidRequestError, match="has finished"):
        one.decode(["a"])
    assert one.release("a") is None

    # context limit -> "length"
    short = make_engine(model, tokenizer=tok, max_seq_len=16, cache_tokens=32)
    out = _events(short, p, GenerationParams(sampling=GREEDY, max_new_tokens=100))
    assert out[-1].finish_reason == "length" and out[-1].completion_tokens == 4

    # EOS from the model config -> "stop", its text not emitted; ignore_eos runs past it
    model.config = replace(model.config, eos_token_ids=(ref[5],))
    try:
        k = ref.index(ref[5])
        out = _events(make_engine(model, tokenizer=tok), p, GenerationParams(sampling=GREEDY, max_new_tokens=12))
        assert out[-1].finish_reason == "stop" and out[-1].completion_tokens == k + 1
        assert "".join(e.text for e in out) == letters[:k]
        out = _events(make_engine(model, tokenizer=tok), p,
                      GenerationParams(sampling=GREEDY, max_new_tokens=12, ignore_eos=True))
        assert out[-1].finish_reason == "length"
    finally:
        model.config = replace(model.config, eos_token_ids=())

    # stop token ids
    out = _events(engine, p, GenerationParams(sampling=GREEDY, max_new_tokens=12, stop_token_ids=[ref[3]]))
    assert out[-1].finish_reason == "stop" and out[-1].token_ids[-1] == ref[3]

    # stop string: held back while forming, cut at the match
    stop = letters[6:9]
    at = letters.index(stop)
    out = _events(engine, p, GenerationParams(sampling=GREEDY, max_new_tokens=12, stop=[stop]))
    assert out[-1].finish_reason == "stop"
    assert "".join(e.text for e in out) == letters[:at]
    emitted = ""
    for e in out:  # no event ever shows text that later turns out to be part of the stop string
        emitted += e.text
        assert letters[:at].startswith(emitted)
    engine.assert_no_leaks()


def _events(engine, p, params):
    from exl2_backend.runtime.generate import generate_stream

    return list(generate_stream(engine, p, params))


def test_seeded_sampling_reproducible(model):
    p = prompt(10, seed=4)
    sp = {"temperature": 1.0, "top_p": 0.95, "repetition_penalty": 1.1, "frequency_penalty": 0.2}
    a = run(make_engine(model), ["x"], [p], GenerationParams(SamplingParams(**sp, seed=5), max_new_tokens=16))
    b = run(make_engine(model), ["x"], [p], GenerationParams(SamplingParams(**sp, seed=5), max_new_tokens=16))
    c = run(make_engine(model), ["x"], [p], GenerationParams(SamplingParams(**sp, seed=6), max_new_tokens=16))
    assert a == b and a != c
    # a seeded sequence samples the same tokens whatever else shares its batch
    mixed = run(make_engine(model), ["x", "y", "z"], [p, prompt(30), prompt(5)],
                GenerationParams(SamplingParams(**sp, seed=5), max_new_tokens=16))
    assert mixed["x"] == a["x"]
