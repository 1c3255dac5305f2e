"""Speculative decoding on the real default model (SmolLM2-135M-Instruct, CPU): greedy output identical to plain
decoding with n-gram drafting and with a draft model (the FP16 SmolLM2 drafting for the EXL2 target), batch 1 and
batched, on chat and code-editing prompts."""

from __future__ import annotations

import pytest

from exl2_backend.model import LlamaModel
from exl2_backend.runtime import Engine, GenerationParams, LoadSettings
from exl2_backend.sampling import SamplingParams
from exl2_backend.tokenizer import Tokenizer
from tests.engine.test_engine import run

pytestmark = pytest.mark.slow

CODE = "def area(w, h):\n    return w * h\n\n\ndef perimeter(w, h):\n    return 2 * (w + h)\n"
CHATS = [
    "Rename the function area to rect_area in this code and show the whole file:\n\n" + CODE,
    "What is the capital of France?",
    "Summarize in one sentence: The cat sat on the mat. The cat was warm. The mat was red.",
]
PARAMS = GenerationParams(sampling=SamplingParams.greedy(), max_new_tokens=24)
SETTINGS = {"device": "cpu", "max_seq_len": 512, "cache_tokens": 2048, "page_size": 16}


@pytest.fixture(scope="module")
def smol(default_model_dir):
    model = LlamaModel.from_dir(default_model_dir, "cpu")
    tok = Tokenizer.from_dir(default_model_dir)
    prompts = [tok.encode_chat([{"role": "user", "content": c}]) for c in CHATS]
    ids = [f"c{i}" for i in range(len(prompts))]
    plain = run(Engine(model, tok, LoadSettings(**SETTINGS)), ids, prompts, PARAMS)
    return model, tok, ids, prompts, plain


@pytest.mark.parametrize("mode", ["ngram", "draft_model"])
def test_greedy_identical_on_smollm2(smol, default_fp16_dir, mode):
    model, tok, ids, prompts, plain = smol
    kw = {"ngram": True} if mode == "ngram" else {"draft_model": default_fp16_dir}
    e = Engine(model, tok, LoadSettings(**SETTINGS, **kw))
    alone = run(e, ids[:1], prompts[:1], PARAMS)  # batch 1: the code-editing prompt
    assert alone[ids[0]] == plain[ids[0]], tok.decode(alone[ids[0]])
    together = run(e, ids, prompts, PARAMS)  # batched
    assert together == plain
    st = e.stats()
    assert st["spec_accepted_tokens"] > 0 and st["spec_tokens_per_step"] > 1.0


def test_the_draft_proposes_with_the_targets_bias(smol, default_fp16_dir):
    """A greedy sequence with a logit bias that forces one token: the draft model proposes from the biased
    distribution too, so every draft is that token and every draft is accepted (unbiased drafts would all be
    rejected); the output is plain decoding's, the forced token throughout."""
    model, tok, ids, prompts, _ = smol
    forced = tok.encode(" yes", add_special_tokens=False)[0]
    params = GenerationParams(sampling=SamplingParams.greedy(), max_new_tokens=12, ignore_eos=True,
                              logit_bias={forced: 100.0})
    plain = run(Engine(model, tok, LoadSettings(**SETTINGS)), ids[:1], prompts[:1], params)
    e = Engine(model, tok, LoadSettings(**SETTINGS, draft_model=default_fp16_dir))
    out = run(e, ids[:1], prompts[:1], params)
    assert out == plain and set(out[ids[0]]) == {forced}
    st = e.stats()
    assert st["spec_proposed_tokens"] > 0 and st["spec_accepted_tokens"] == st["spec_proposed_tokens"]


@pytest.mark.parametrize("mode", ["ngram", "draft_model"])
def test_min_new_tokens_under_speculation(smol, default_fp16_dir, mode):
    """EOS forced by a +100 bias but banned for the first 6 tokens: speculative decoding gives plain decoding's
    output, 6 tokens then EOS (the draft model proposes under the same ban)."""
    model, tok, ids, prompts, _ = smol
    eos = 2  # <|im_end|>
    params = GenerationParams(sampling=SamplingParams.greedy(), max_new_tokens=12, min_new_tokens=6,
                              logit_bias={eos: 100.0})
    plain = run(Engine(model, tok, LoadSettings(**SETTINGS)), ids[:1], prompts[:1], params)
    kw = {"ngram": True} if mode == "ngram" else {"draft_model": default_fp16_dir}
    out = run(Engine(model, tok, LoadSettings(**SETTINGS, **kw)), ids[:1], prompts[:1], params)
    assert out == plain and len(out[ids[0]]) == 7 and out[ids[0]][-1] == eos and eos not in out[ids[0]][:-1]
