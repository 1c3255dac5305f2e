"""The engine with every KV cache type (fp16, fp8, q8, q6, q4) on CPU: chunked prefill over quantized history,
batched decode, draft verification and page accounting on a tiny EXL2 model; the quality cost of each cache type
on the default model (SmolLM2-135M, FP16 weights) as KL divergence against the fp16-cache run of the same
weights."""

from __future__ import annotations

import pytest
import torch

from exl2_backend.cache.kv_types import CACHE_TYPE_NAMES
from exl2_backend.runtime import Engine, GenerationParams, LoadSettings
from exl2_backend.sampling import SamplingParams
from tests.helpers.synth import tiny_config_dict, write_tiny_exl2_model

QUANTIZED = [t for t in CACHE_TYPE_NAMES if t != "fp16"]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return write_tiny_exl2_model(tmp_path_factory.mktemp("tiny"), tiny_config_dict())  # head_dim 32, GQA 4/2


def _engine(model_dir, cache_type, **kw) -> Engine:
    s = {"model_dir": model_dir, "device": "cpu", "max_seq_len": 256, "cache_tokens": 1024, "page_size": 16,
         "max_chunk_size": 24, "cache_type": cache_type}
    s.update(kw)
    return Engine.load(LoadSettings(**s))


def _run(engine: Engine, prompts: dict[str, list[int]], new_tokens: int) -> dict[str, list[int]]:
    params = GenerationParams(sampling=SamplingParams.greedy(), max_new_tokens=new_tokens, ignore_eos=True)
    out = {sid: [] for sid in prompts}
    for sid, ids in prompts.items():
        engine.add_sequence(sid, ids, params)
    pending = list(prompts)
    for _ in range(100):  # prefill chunks until every prompt has its first token
        if not pending:
            break
        for ev in engine.prefill(pending):
            out[ev.seq_id] += ev.token_ids
            assert ev.error is None, ev.error
        pending = [s for s in pending if not out[s]]
    for _ in range(new_tokens):
        live = [s for s in prompts if engine.seqs[s].finish_reason is None]
        if not live:
            break
        for ev in engine.decode(live):
            assert ev.error is None, ev.error
            out[ev.seq_id] += ev.token_ids
    return out


@pytest.mark.parametrize("cache_type", CACHE_TYPE_NAMES)
def test_engine_runs_every_cache_type(tiny_dir, cache_type):
    engine = _engine(tiny_dir, cache_type)
    assert engine.cache.cache_type.name == cache_type
    g = torch.Generator().manual_seed(0)
    prompts = {"a": torch.randint(0, 290, (70,), generator=g).tolist(),  # 3 chunks of 24: history in 2 pages
               "b": torch.randint(0, 290, (9,), generator=g).tolist()}
    out = _run(engine, prompts, 12)
    assert all(len(v) == 12 and all(0 <= t < 300 for t in v) for v in out.values())
    for sid in prompts:
        engine.release(sid)
    engine.assert_no_leaks()


@pytest.mark.parametrize("cache_type", ["q4", "q6"])
def test_prefix_cache_reuses_quantized_pages(tiny_dir, cache_type):
    """A repeated prompt reuses the cached quantized pages (codes and scales, including the copy-on-write of
    a partial page) and yields the tokens of the first run."""
    engine = _engine(tiny_dir, cache_type)
    g = torch.Generator().manual_seed(3)
    prompt = torch.randint(0, 290, (53,), generator=g).tolist()  # 3 full pages of 16 and a partial one
    first = _run(engine, {"a": prompt}, 8)["a"]
    engine.release("a")
    hits = engine.stats().get("prefix_hit_tokens", 0)
    again = _run(engine, {"b": prompt}, 8)["b"]
    assert again == first
    assert engine.stats().get("prefix_hit_tokens", 0) > hits  # the second prompt was served from the cache
    engine.release("b")
    engine.assert_no_leaks()


def _last_logits(model_dir, cache_type, ids: list[int]) -> torch.Tensor:
    """Logits after prefilling `ids` in chunks of 24 (the history read back from `cache_type` pages)."""  # [V]
    engine = _engine(model_dir, cache_type)
    run, seen = engine.runner.run, {}

    def capture(*args, **kw):
        seen["logits"] = out = run(*args, **kw)
        return out

    engine.runner.run = capture
    _run(engine, {"a": ids}, 1)
    return seen["logits"][0].float()


def test_quantized_cache_matches_fp16_greedy_on_tiny_model(tiny_dir):
    """fp8 and q8 caches give the fp16-cache tokens on the tiny model for 16 steps, q6 and q4 for 4, except
    at a near tie: where a cache type first picks another token, fp16's top two logits are within that cache
    type's logit error (1% of the logit range for fp8/q8, 3% for q6/q4) and its logits there are within that
    error of fp16's. (Seed 1 has such a tie at step 15, top-2 gap 1.4e-4 of a 4.8 range: fp8/q8 flip it.)"""
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, 290, (50,), generator=g).tolist()
    want = _run(_engine(tiny_dir, "fp16"), {"a": prompt}, 16)["a"]
    for ct in QUANTIZED:
        got = _run(_engine(tiny_dir, ct), {"a": prompt}, 16)["a"]
        n, rel = (16, 0.01) if ct in ("fp8", "q8") else (4, 0.03)
        k = next((i for i in range(n) if got[i] != want[i]), n)
        if k == n:
            continue
        ref = _last_logits(tiny_dir, "fp16", prompt + want[:k])
        out = _last_logits(tiny_dir, ct, prompt + want[:k])
        tol = rel * float(ref.max() - ref.min())
        top2 = ref.topk(2).values
        assert int(ref.argmax()) == want[k] and int(out.argmax()) == got[k], (ct, k)
        assert float(top2[0] - top2[1]) < tol, (ct, k, "diverged without a near tie", got, want)
        assert float((out - ref).abs().max()) < tol, (ct, k)


def test_verify_drafts_over_a_quantized_cache(tiny_dir):
    """Draft verification writes and rolls back K/V in quantized pages like in fp16 ones: drafting the tokens
    plain decoding produces accepts them all and yields the same continuation."""
    g = torch.Generator().manual_seed(2)
    prompt = torch.randint(0, 290, (30,), generator=g).tolist()
    plain = _run(_engine(tiny_dir, "q4"), {"a": prompt}, 9)["a"]
    engine = _engine(tiny_dir, "q4")
    params = GenerationParams(sampling=SamplingParams.greedy(), max_new_tokens=9, ignore_eos=True)
    engine.add_sequence("a", prompt, params)
    first = []
    while not first:
        first = engine.prefill(["a"])[0].token_ids
    ev = engine.verify(["a"], {"a": plain[1:5] + [(plain[5] + 1) % 290]})[0]  # 4 right drafts, one wrong
    assert first + ev.token_ids == plain[:6]
    rest = []
    while engine.seqs["a"].finish_reason is None:
        rest += engine.decode(["a"])[0].token_ids
    assert first + ev.token_ids + rest == plain
    engine.release("a")
    engine.assert_no_leaks()


def test_cache_bytes_in_engine_sizing(tiny_dir):
    """A byte budget holds proportionally more tokens of a quantized cache (cache_tokens from the budget)."""
    from exl2_backend.cache import kv_bytes_per_token

    fp16 = kv_bytes_per_token(2, 2, 32, torch.float16, "fp16")
    q4 = kv_bytes_per_token(2, 2, 32, torch.float16, "q4")
    assert q4 * 16 == fp16 * 4.5
    e = _engine(tiny_dir, "q4", cache_tokens=None, max_batch_size=2)
    assert e.cache.bytes_per_token() == q4
    assert e.stats()["cache_type"] == "q4" and e.stats()["cache_bytes_per_token"] == q4
    assert e.cache.k[0].dtype == torch.uint8 and e.cache.k_scales[0].dtype == torch.float16


# --- quality on the default model -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def smollm(default_fp16_dir):
    """SmolLM2-135M's FP16 weights: the cache type's own cost, independent of weight quantization."""
    from exl2_backend.model import LlamaModel
    from exl2_backend.quant.evaluate import tokenize_eval_text

    ids, bos = tokenize_eval_text(default_fp16_dir, max_tokens=255)
    return LlamaModel.from_dir(default_fp16_dir, "cpu"), ids, bos


def test_kl_per_cache_type_on_smollm2(smollm):
    """KL(fp16 cache || cache type) of the same SmolLM2 weights over a window of 256 tokens: the 8-bit types
    are near-lossless, q6 (K 8-bit, V 4-bit) beats q4, and q4 stays small. Measured here (2 windows, 510
    tokens): fp8 0.0043, q8 0.00013, q6 0.0049, q4 0.038 nats/token."""
    from exl2_backend.quant.evaluate import evaluate_models

    model, ids, bos = smollm
    kl = {ct: evaluate_models(model, model, ids, window=256, bos=bos, cache_type=ct).kl_mean for ct in QUANTIZED}
    assert kl["q8"] < 1e-3 and kl["fp8"] < 0.015 and kl["q6"] < 0.015, kl
    assert kl["q8"] < kl["q6"] < kl["q4"] < 0.08 and kl["fp8"] < kl["q4"], kl
