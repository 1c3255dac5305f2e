"""Speculative decoding on the GPU (SmolLM2): greedy output identical to plain GPU decoding for n-gram and
draft-model drafting (batch 1 and batched), verify steps replayed from CUDA graphs with the eager path's logits,
the draft decoding from its own graphs, and a draft that does not fit refused before anything is allocated."""

from __future__ import annotations

import pytest
import torch

from exl2_backend.errors import ConfigError
from exl2_backend.runtime import Engine, GenerationParams, LoadSettings
from exl2_backend.runtime.model_runner import ModelRunner
from exl2_backend.sampling import SamplingParams
from exl2_backend.spec.verify_graphs import VerifyGraphRunner
from tests.engine.test_engine import run

pytestmark = pytest.mark.cuda

CHATS = [
    ("Rename the function area to rect_area in this code and show the whole file:\n\n"
     "def area(w, h):\n    return w * h\n\n\ndef perimeter(w, h):\n    return 2 * (w + h)\n"),
    "What is the capital of France?",
    "Write a short poem about the sea.",
]
PARAMS = GenerationParams(sampling=SamplingParams.greedy(), max_new_tokens=64, ignore_eos=True)
SETTINGS = {"device": "cuda", "max_seq_len": 1024, "max_batch_size": 4}


@pytest.fixture(scope="module")
def plain(default_model_dir):
    e = Engine.load(LoadSettings(model_dir=default_model_dir, **SETTINGS))
    prompts = [e.tokenizer.encode_chat([{"role": "user", "content": c}]) for c in CHATS]
    ids = [f"c{i}" for i in range(len(prompts))]
    alone = run(e, ids[:1], prompts[:1], PARAMS)  # batch 1 and batch 3 references (GPU batch invariance is
    return ids, prompts, alone, run(e, ids, prompts, PARAMS)  # bitwise only up to near ties)


@pytest.mark.parametrize("mode", ["ngram", "draft_model"])
def test_gpu_greedy_identical(plain, default_model_dir, mode):
    ids, prompts, ref_alone, ref = plain
    kw = {"ngram": True} if mode == "ngram" else {"draft_model": default_model_dir}  # self-drafting: all accepted
    e = Engine.load(LoadSettings(model_dir=default_model_dir, **SETTINGS, **kw))
    assert isinstance(e.runner, VerifyGraphRunner)
    alone = run(e, ids[:1], prompts[:1], PARAMS)
    assert alone[ids[0]] == ref_alone[ids[0]]
    assert run(e, ids, prompts, PARAMS) == ref
    assert e.runner.verify_replays > 0  # verify steps replayed graphs
    if mode == "draft_model":
        assert type(e.spec.draft.runner).__name__ == "CudaGraphRunner" and e.spec.draft.runner.replays > 0
        assert e.stats()["spec_acceptance_rate"] > 0.9  # the draft is the target itself
    e.assert_no_leaks()


def test_sampled_draft_model_on_gpu_runs_clean(default_model_dir, default_fp16_dir):
    e = Engine.load(LoadSettings(model_dir=default_model_dir, draft_model=default_fp16_dir, **SETTINGS))
    params = GenerationParams(sampling=SamplingParams(temperature=0.8, top_p=0.95, seed=3), max_new_tokens=48)
    prompts = [e.tokenizer.encode_chat([{"role": "user", "content": c}]) for c in CHATS]
    out = run(e, ["a", "b", "c"], prompts, params)
    assert all(len(v) > 0 for v in out.values())
    st = e.stats()
    assert 0 < st["spec_accepted_tokens"] <= st["spec_proposed_tokens"]
    e.assert_no_leaks()


def test_verify_graph_logits_match_eager(default_model_dir):
    e = Engine.load(LoadSettings(model_dir=default_model_dir, ngram=True, **SETTINGS))
    runner = e.runner
    g = torch.Generator().manual_seed(0)
    for b, tq in [(1, 5), (3, 5), (2, 3)]:  # Tq up to k + 1 = 5 replays graphs
        pages = [[2 * i, 2 * i + 1] for i in range(b)]  # pages untouched by any sequence (none is admitted)
        tokens = torch.randint(0, 1000, (b, tq), generator=g).tolist()
        starts = [37 + 11 * i for i in range(b)]
        graph = runner.run(tokens, starts, pages, "all").clone()  # [b, tq, V]
        eager = ModelRunner.run(runner.inner, tokens, starts, pages, "all")  # the same forward, no graph
        assert graph.shape == eager.shape
        scale = (eager.amax(-1) - eager.amin(-1)).max()
        assert float((graph - eager).abs().max()) <= 0.02 * float(scale)
    assert runner.verify_replays == 3


def test_draft_that_does_not_fit_fails_before_allocating(default_model_dir):
    import gc

    gc.collect()
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    free = torch.cuda.mem_get_info()[0]
    huge = int(free // 2048) * 64  # far more KV tokens than the GPU holds
    with pytest.raises(ConfigError):
        Engine.load(LoadSettings(model_dir=default_model_dir, draft_model=default_model_dir, device="cuda",
                                 max_seq_len=2048, cache_tokens=huge))
    assert torch.cuda.memory_allocated() <= before  # nothing allocated (a collection may only free)
