"""Speculation behind the hooks and in the continuous-batching loop of the LitServe host: a handle loaded with
`ngram` / `draft_model` settings decodes several tokens per `exl2_decode` call, concurrent requests joining and
leaving the batch get exactly the plain greedy output, and the acceptance figures reach /metrics."""

from __future__ import annotations

import asyncio

import pytest
import torch

from exl2_backend.plugin.manager import new_plugin_manager
from exl2_backend.plugin.types import SequenceRequest, StepBatch
from exl2_backend.serve.engine_loop import EngineLoop
from exl2_backend.serve.metrics import render_metrics
from tests.helpers.synth import tiny_config_dict, write_tiny_exl2_model

LOAD = {"device": "cpu", "max_seq_len": 256, "cache_tokens": 2048, "page_size": 16, "max_batch_size": 8}


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("spec_serve")
    cfg = tiny_config_dict()  # vocab 300 with a byte-level tokenizer
    return (write_tiny_exl2_model(root / "target", cfg, seed=0, head_bits=8),
            write_tiny_exl2_model(root / "draft", cfg, seed=0, head_bits=2))


def _requests(n: int) -> list[SequenceRequest]:
    g = torch.Generator().manual_seed(4)
    out = []
    for i in range(n):
        span = torch.randint(0, 256, (6 + i,), generator=g).tolist()
        out.append(SequenceRequest(f"r{i}", prompt_ids=span + span, temperature=0.0, max_new_tokens=12 + 5 * i,
                                   ignore_eos=True))
    return out


def _serve(pm, handle, requests) -> dict[str, list[int]]:
    loop = EngineLoop(pm.hook, handle, max_batch_size=4, max_queue=16).start()  # 6 requests: some wait

    async def collect(stream) -> list[int]:
        return [t async for ev in stream for t in ev.token_ids]

    async def main():
        streams = [loop.submit(r) for r in requests]
        return [await collect(s) for s in streams]

    try:
        outs = asyncio.run(main())
        stats = loop.stats()
    finally:
        loop.stop()
    assert stats["active_sequences"] == 0 and stats["backend"]["free_pages"] == stats["backend"]["total_pages"]
    return {r.seq_id: o for r, o in zip(requests, outs)}, stats


@pytest.mark.parametrize("spec", ["ngram", "draft_model"])
def test_engine_loop_with_speculation_matches_plain(model_dirs, spec):
    target, draft = model_dirs
    pm = new_plugin_manager(builtin_fallback=True)
    caps = pm.hook.exl2_capabilities()[0]
    assert "ngram" in caps["speculative_decoding"] and caps["speculative_sampling"] == "rejection"
    plain_h = pm.hook.exl2_load(settings={"model_dir": str(target), **LOAD})
    extra = {"ngram": True} if spec == "ngram" else {"draft_model": str(draft)}
    spec_h = pm.hook.exl2_load(settings={"model_dir": str(target), **LOAD, **extra, "num_speculative_tokens": 3})
    try:
        reqs = _requests(6)
        plain, _ = _serve(pm, plain_h, reqs)
        got, stats = _serve(pm, spec_h, _requests(6))
        assert got == plain
        assert all(len(v) == r.max_new_tokens for v, r in zip(got.values(), reqs))
        backend = stats["backend"]
        assert backend["spec_mode"] == spec and backend["spec_accepted_tokens"] > 0
        assert stats["steps"]["decode"] < sum(r.max_new_tokens for r in reqs)  # several tokens per decode call
        metrics = render_metrics(stats, "m")
        assert 'exl2_backend_spec_acceptance_rate{model="m"}' in metrics
        assert "exl2_backend_spec_accepted_tokens_total" in metrics
    finally:
        pm.hook.exl2_unload(handle=plain_h)
        pm.hook.exl2_unload(handle=spec_h)


def test_decode_hook_returns_several_tokens(model_dirs):
    target, _ = model_dirs
    pm = new_plugin_manager(builtin_fallback=True)
    h = pm.hook.exl2_load(settings={"model_dir": str(target), **LOAD, "ngram": {"min_n": 1, "max_n": 2},
                                    "num_speculative_tokens": 5})
    try:
        req = SequenceRequest("a", prompt_ids=[5, 6, 7, 5, 6, 7, 5, 6], temperature=0.0, max_new_tokens=40,
                              ignore_eos=True)
        ev = pm.hook.exl2_prefill(handle=h, batch=StepBatch(new=[req]))[0]
        counts = []
        while not ev.finished:
            ev = pm.hook.exl2_decode(handle=h, batch=StepBatch(seq_ids=["a"]))[0]
            counts.append(len(ev.token_ids))
        assert ev.usage.completion_tokens == 40 and max(counts) > 1
        assert pm.hook.exl2_stats(handle=h)["spec_tokens_per_step"] > 1.0
    finally:
        pm.hook.exl2_unload(handle=h)
