"""Publishing step i's events from step i+1's launch (StepBatch.on_launched, hook API 1.1) changes when
events reach the asyncio side, never what they are: a tiny synthetic EXL2 model on the CPU, real files."""

from __future__ import annotations

import asyncio

import pytest

from exl2_backend.plugin.manager import get_plugin_manager
from exl2_backend.plugin.types import SequenceRequest, StepBatch
from exl2_backend.runtime import Engine, GenerationParams, LoadSettings
from exl2_backend.runtime.generate import generate_stream
from exl2_backend.sampling import SamplingParams
from exl2_backend.serve.engine_loop import EngineLoop
from tests.helpers.synth import tiny_config_dict, write_tiny_exl2_model


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_tiny_exl2_model(tmp_path_factory.mktemp("tiny") / "m", tiny_config_dict(), seed=3)


def _decode_all(engine, on_launched=None) -> tuple[list[list[int]], int]:
    params = GenerationParams(sampling=SamplingParams.greedy(), max_new_tokens=6, ignore_eos=True)
    ids = ["a", "b"]
    out = {sid: [] for sid in ids}
    for i, sid in enumerate(ids):
        engine.add_sequence(sid, [5 + i, 17, 42, 7 * i + 1], params)
        while not out[sid]:
            out[sid] += engine.prefill([sid])[0].token_ids
    calls = 0
    while ids:
        before = {sid: engine.seqs[sid].num_computed for sid in ids}

        def cb(before=before, ids=ids):
            nonlocal calls
            calls += 1
            # on the CPU the callback runs before the (synchronous) forward: nothing of this step happened yet
            assert all(engine.seqs[sid].num_computed == before[sid] for sid in ids)
            if on_launched is not None:
                on_launched()

        for ev in engine.decode(ids, on_launched=cb):
            out[ev.seq_id] += ev.token_ids
        ids = [sid for sid in ids if not engine.seqs[sid].finished]
    for sid in out:
        engine.release(sid)
    engine.assert_no_leaks()
    return [out["a"], out["b"]], calls


def test_engine_calls_on_launched_once_per_decode_and_tokens_do_not_change(model_dir):
    engine = Engine.load(LoadSettings(model_dir=str(model_dir), device="cpu", max_seq_len=64, max_batch_size=4,
                                      cache_tokens=1024, page_size=16))
    plain = []
    params = GenerationParams(sampling=SamplingParams.greedy(), max_new_tokens=6, ignore_eos=True)
    for i in range(2):
        plain.append([t for ev in generate_stream(engine, [5 + i, 17, 42, 7 * i + 1], params) for t in ev.token_ids])
    tokens, calls = _decode_all(engine)
    assert tokens == plain
    assert calls == 5  # 6 tokens: the first from prefill, then 5 decode calls, one callback each

    def boom():
        raise RuntimeError("host bug")

    tokens, _ = _decode_all(engine, on_launched=boom)  # a failing host callback never fails the sequences
    assert tokens == plain


@pytest.mark.parametrize("publish_on_launch", [True, False])
def test_engine_loop_delivers_every_event_in_order(model_dir, publish_on_launch):
    pm = get_plugin_manager(builtin_fallback=True)
    handle = pm.hook.exl2_load(settings={"model_dir": str(model_dir), "device": "cpu", "max_seq_len": 64,
                                         "cache_tokens": 1024, "page_size": 16, "max_batch_size": 4})
    reqs = [SequenceRequest(f"s{i}", prompt_ids=[3 + i, 9, 27, 81 % (i + 2) + 1], max_new_tokens=4 + 3 * i,
                            temperature=0.0, ignore_eos=True) for i in range(3)]
    # what the hooks give when driven one sequence at a time
    alone = {}
    for r in reqs:
        ev, = pm.hook.exl2_prefill(handle=handle, batch=StepBatch(new=[SequenceRequest(**r.__dict__)]))
        toks = list(ev.token_ids)
        while not ev.finished:
            ev, = pm.hook.exl2_decode(handle=handle, batch=StepBatch(seq_ids=[r.seq_id]))
            toks += ev.token_ids
        alone[r.seq_id] = toks

    async def main():
        loop = EngineLoop(pm.hook, handle, max_batch_size=4, publish_on_launch=publish_on_launch).start()
        try:
            async def one(r, delay):
                await asyncio.sleep(delay)  # join a batch that is already decoding
                events = [ev async for ev in loop.submit(r)]
                return events

            return await asyncio.gather(*(one(r, 0.02 * i) for i, r in enumerate(reqs)))
        finally:
            loop.stop()

    results = asyncio.run(main())
    for r, events in zip(reqs, results):
        assert [e.finished for e in events] == [False] * (len(events) - 1) + [True]
        assert events[-1].finish_reason == "length"
        assert [t for e in events for t in e.token_ids] == alone[r.seq_id]
        assert events[-1].usage.completion_tokens == r.max_new_tokens
    assert handle.stats()["running"] == 0
    handle.engine.assert_no_leaks()
