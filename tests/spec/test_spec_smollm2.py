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
