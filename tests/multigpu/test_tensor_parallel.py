"""Tensor parallelism on the CPU: two real ranks (this process and one spawned worker) over gloo give the
single-process greedy tokens, and logits within fp32 reduction-order tolerance. The weight split itself
(model/tp_shard.py) is checked rank by rank against the full layer."""

from __future__ import annotations

import pytest
import torch

from exl2_backend.errors import ConfigError
from exl2_backend.format.config import ModelConfig
from exl2_backend.format.reader import load_weights
from exl2_backend.model.tp_shard import head_columns, shard_layer
from exl2_backend.ops import reference
from exl2_backend.runtime import Engine, GenerationParams, LoadSettings
from exl2_backend.sampling import SamplingParams
from tests.helpers.synth import tiny_config_dict, write_tiny_exl2_model, write_tiny_fp16_model

GREEDY = GenerationParams(sampling=SamplingParams.greedy(), max_new_tokens=10, ignore_eos=True)
PROMPTS = [[5, 17, 200, 3, 99, 41], [8, 8, 9], list(range(30, 75))]


def _dense(lin) -> torch.Tensor:
    """[K, N] float64 weight of a QTensor or DenseLinear."""
    if hasattr(lin, "q_weight"):
        return reference.exl2_dequant(lin).double()[:, : lin.out_features]
    return lin.weight.double().t()


@pytest.mark.parametrize("kind", ["exl2", "fp16"])
def test_shards_reassemble_the_layer(tmp_path, kind):
    cfg = tiny_config_dict(num_hidden_layers=1, intermediate_size=384)
    d = (write_tiny_exl2_model if kind == "exl2" else write_tiny_fp16_model)(tmp_path / "m", cfg, seed=1)
    config = ModelConfig.from_dir(d)
    lw = load_weights(d, config).layers[0]
    x = torch.randn(3, config.hidden_size, dtype=torch.float64)
    world = 2
    parts = [shard_layer(lw, config, r, world) for r in range(world)]
    # attention: q/k/v columns are head blocks in rank order; o_proj is whole on every rank
    for proj in ("q_proj", "k_proj", "v_proj"):
        full = x @ _dense(getattr(lw, proj))
        assert torch.equal(torch.cat([x @ _dense(getattr(p, proj)) for p in parts], 1), full)
    assert all(p.o_proj is lw.o_proj for p in parts)
    # MLP: gate/up columns feed exactly the rank's down rows; partial downs add up to the full MLP
    act = lambda g, u: torch.nn.functional.silu(g) * u
    full = act(x @ _dense(lw.gate_proj), x @ _dense(lw.up_proj)) @ _dense(lw.down_proj)
    total = sum(act(x @ _dense(p.gate_proj), x @ _dense(p.up_proj)) @ _dense(p.down_proj) for p in parts)
    torch.testing.assert_close(total, full, rtol=1e-10, atol=1e-10)
    cols = torch.cat([head_columns(config.vocab_size, r, world) for r in range(world)])[: config.vocab_size]
    assert torch.equal(cols, torch.arange(config.vocab_size))


def _generate(engine) -> tuple[dict[str, list[int]], torch.Tensor]:
    ids = [f"s{i}" for i in range(len(PROMPTS))]
    for sid, p in zip(ids, PROMPTS):
        engine.add_sequence(sid, p, GREEDY)
    toks = {sid: [] for sid in ids}
    for ev in engine.prefill(ids):
        toks[ev.seq_id] += ev.token_ids
    for _ in range(GREEDY.max_new_tokens - 1):
        for ev in engine.decode(ids):
            toks[ev.seq_id] += ev.token_ids
    for sid in ids:
        engine.release(sid)
    engine.assert_no_leaks()
    logits = engine.runner.run([[3]], [0], [[0]], "last")  # one more step on page 0: compare raw logits
    return toks, logits


@pytest.mark.parametrize("kind,tied", [("exl2", False), ("fp16", True)], ids=["exl2-untied", "fp16-tied"])
def test_two_gloo_ranks_match_one_process(tmp_path, kind, tied):
    cfg = tiny_config_dict(num_hidden_layers=3, intermediate_size=384, tie_word_embeddings=tied)
    d = (write_tiny_exl2_model if kind == "exl2" else write_tiny_fp16_model)(tmp_path / "m", cfg, seed=2)
    common = {"model_dir": d, "device": "cpu", "max_seq_len": 128, "cache_tokens": 512, "page_size": 16,
              "max_batch_size": 4}
    ref_toks, ref_logits = _generate(Engine.load(LoadSettings(**common)))
    tp = Engine.load(LoadSettings(tensor_parallel=2, **common))
    try:
        assert tp.model.world == 2 and tp.model.plan.mode == "tensor_parallel"
        assert tp.cache.num_kv_heads == cfg["num_key_value_heads"] // 2
        toks, logits = _generate(tp)
    finally:
        tp.close()
    assert toks == ref_toks
    # fp32 everywhere; only the order of the reductions differs (partial sums over two ranks)
    torch.testing.assert_close(logits, ref_logits, rtol=1e-4, atol=1e-4)


def test_tensor_parallel_must_divide_the_heads(tmp_path):
    d = write_tiny_exl2_model(tmp_path / "m", tiny_config_dict(num_hidden_layers=1), seed=0)
    with pytest.raises(ConfigError, match="divide"):
        Engine.load(LoadSettings(model_dir=d, device="cpu", tensor_parallel=4, max_seq_len=64))
