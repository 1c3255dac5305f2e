"""Decode lookahead on a tiny random EXL2 model on the GPU: tokens equal plain graph decoding, batched with
sequences finishing at different steps and alone, no KV page leaked. test_lookahead.py asks the same of SmolLM2,
whose wheel does not fit a device call's carry; this model is written by the test. A vocabulary of 40,000 puts
the greedy sampler (ops.greedy_tokens) over 20 chunks per row."""

from __future__ import annotations

import pytest
import torch

from tests.helpers.greedy_runs import run_greedy_batch

pytestmark = pytest.mark.cuda


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    from exl2_backend import ops
    from exl2_backend.runtime import Engine, LoadSettings
    from tests.helpers.synth import tiny_config_dict, write_tiny_exl2_model

    if not torch.cuda.is_available() or not ops.cuda_enabled():
        pytest.skip("needs a GPU and the compiled kernel library")
    cfg = tiny_config_dict(hidden_size=1024, intermediate_size=2816, num_attention_heads=8, num_key_value_heads=2,
                           num_hidden_layers=4, vocab_size=40000, bos_token_id=1, eos_token_id=2)
    model_dir = write_tiny_exl2_model(tmp_path_factory.mktemp("lookahead") / "m", cfg, seed=3)
    eng = Engine.load(LoadSettings(model_dir=str(model_dir), device="cuda", max_seq_len=512, max_batch_size=4))
    assert eng.lookahead is not None
    return eng


def test_lookahead_tokens_identical_on_a_tiny_model(engine):
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
