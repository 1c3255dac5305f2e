"""Layer split (model/split.py) with every segment on the CPU: the split code path -- per-segment caches and
layers, hidden states handed across segment boundaries, the embedding first and the head last -- gives the
unsplit model's logits and greedy tokens bit for bit, through the model and through Engine.load(gpu_split=...)."""

from __future__ import annotations

import itertools

import pytest
import torch

from exl2_backend.errors import ConfigError
from exl2_backend.format.config import ModelConfig
from exl2_backend.format.reader import load_weights
from exl2_backend.model import LlamaModel
from exl2_backend.model.split import Segment, SegmentedKVCache, SplitLlamaModel
from exl2_backend.plan import describe_dir, plan_load
from exl2_backend.plan.vram import GB
from exl2_backend.runtime import Engine, GenerationParams, LoadSettings
from exl2_backend.runtime.model_runner import ModelRunner
from exl2_backend.sampling import SamplingParams
from tests.helpers.synth import tiny_config_dict, write_tiny_exl2_model

CPU = torch.device("cpu")
GREEDY = GenerationParams(sampling=SamplingParams.greedy(), max_new_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module", params=[False, True], ids=["untied", "tied"])
def model_dir(request, tmp_path_factory):
    cfg = tiny_config_dict(num_hidden_layers=4, tie_word_embeddings=request.param)
    return write_tiny_exl2_model(tmp_path_factory.mktemp("split") / "m", cfg, seed=3)


def _segments(cuts: list[int], n: int = 4) -> list[Segment]:
    bounds = [0, *cuts, n]
    return [Segment(CPU, a, b) for a, b in itertools.pairwise(bounds)]


def _logits(model, steps: list[list[int]]) -> list[torch.Tensor]:
    """Prefill steps[0], then decode one token per later step; f32 logits of every step."""
    runner = ModelRunner(model, model.make_cache(8, 16), 8)
    out, pos = [], 0
    for tokens in steps:
        out.append(runner.run([tokens], [pos], [list(range(8))], "all"))
        pos += len(tokens)
    return out


@pytest.mark.parametrize("cuts", [[2], [1, 3], [0, 2], [4]], ids=["2+2", "1+2+1", "0+2+2", "4+0"])
def test_split_logits_identical_to_unsplit(model_dir, cuts):
    config = ModelConfig.from_dir(model_dir)
    weights = load_weights(model_dir, config)
    ref = LlamaModel(config, weights, CPU)
    split = SplitLlamaModel(config, weights, _segments(cuts))
    cache = split.make_cache(8, 16)
    assert isinstance(cache, SegmentedKVCache) and len(cache.segments) == len(cuts) + 1
    assert [c.num_layers for c in cache.segments] == [s.num_layers for s in split.segments]
    steps = [[5, 17, 200, 3, 99, 41, 7], [12], [250], [1]]
    for a, b in zip(_logits(ref, steps), _logits(split, steps)):
        assert torch.equal(a, b)


def test_engine_load_with_cpu_gpu_split_matches_unsplit(model_dir):
    desc = describe_dir(model_dir)
    common = {"model_dir": model_dir, "device": "cpu", "max_seq_len": 128, "cache_tokens": 256, "page_size": 16,
              "max_batch_size": 4}
    roomy = plan_load(LoadSettings(gpu_split=[1.0, 1.0], **common), desc=desc).devices[0]
    layer = desc.layer_bytes(0, "dense", 4) + 256 * desc.kv_bytes_per_token_layer(4)
    first = (desc.embed_bytes(4) + roomy.scratch + 2.5 * layer) / GB  # two of the four layers fit
    split = Engine.load(LoadSettings(gpu_split=[first, 1.0], **common))
    assert isinstance(split.model, SplitLlamaModel)
    assert [(s.first, s.end) for s in split.model.segments] == [(0, 2), (2, 4)]
    assert split.model.plan.mode == "split"
    plain = Engine.load(LoadSettings(**common))
    prompts = [[5, 17, 200, 3, 99], [8, 8, 8], list(range(40, 70))]
    for i, p in enumerate(prompts):  # several sequences at once: batched decode over the split
        split.add_sequence(f"s{i}", p, GREEDY)
        plain.add_sequence(f"s{i}", p, GREEDY)
    ids = [f"s{i}" for i in range(len(prompts))]
    outs = []
    for eng in (split, plain):
        toks = {sid: [] for sid in ids}
        for ev in eng.prefill(ids):
            toks[ev.seq_id] += ev.token_ids
        for _ in range(11):
            for ev in eng.decode(ids):
                toks[ev.seq_id] += ev.token_ids
        outs.append(toks)
        for sid in ids:
            eng.release(sid)
        eng.assert_no_leaks()
    assert outs[0] == outs[1]
    assert all(len(t) == 12 for t in outs[0].values())


def test_prefix_cache_page_copies_reach_every_segment(model_dir):
    """copy_pages (prefix caching's copy-on-write) must copy the page in every segment's cache."""
    config = ModelConfig.from_dir(model_dir)
    split = SplitLlamaModel(config, load_weights(model_dir, config), _segments([1, 3]))
    cache = split.make_cache(4, 16)
    for c in cache.segments:
        for t in c.tensors():
            t[1].normal_()
    cache.copy_pages([1], [3])
    for c in cache.segments:
        for t in c.tensors():
            assert torch.equal(t[1], t[3])


def test_bad_segments_raise(model_dir):
    config = ModelConfig.from_dir(model_dir)
    weights = load_weights(model_dir, config)
    with pytest.raises(ConfigError, match="cover"):
        SplitLlamaModel(config, weights, [Segment(CPU, 0, 3)])
    with pytest.raises(ConfigError, match="order"):
        SplitLlamaModel(config, weights, [Segment(CPU, 0, 2), Segment(CPU, 3, 4)])


def _dequantized(weights):
    """The same weights with every QTensor replaced by its fp16 dequantization (what the reference ops keep)."""
    from dataclasses import fields, replace

    from exl2_backend.format.reader import DenseLinear
    from exl2_backend.ops import reference

    def dense(lin):
        if not hasattr(lin, "q_weight"):
            return lin
        n = lin.out_features
        return DenseLinear(lin.key, reference.exl2_dequant(lin)[:, :n].t().contiguous(),
                           None if lin.bias is None else lin.bias[:n])

    layers = [replace(lw, **{f.name: dense(getattr(lw, f.name)) for f in fields(lw) if f.name.endswith("proj")})
              for lw in weights.layers]
    return replace(weights, layers=layers, lm_head=None if weights.lm_head is None else dense(weights.lm_head))


def test_default_model_split_on_cpu_matches_unsplit(default_model_dir):
    """SmolLM2-135M (30 layers, tied head) split 12 + 18 over two CPU segments: same greedy answer."""
    config = ModelConfig.from_dir(default_model_dir)
    weights = _dequantized(load_weights(default_model_dir, config))  # dequantize once for both models
    prompt = [1, 504, 3458, 282, 4649, 314]  # token ids; their text does not matter here
    outs = []
    for model in (LlamaModel(config, weights, CPU), SplitLlamaModel(config, weights, _segments([12], 30))):
        eng = Engine(model, None, LoadSettings(device="cpu", max_seq_len=64, cache_tokens=64, page_size=16,
                                               max_batch_size=1))
        eng.add_sequence("a", prompt, GREEDY)
        toks = eng.prefill(["a"])[0].token_ids
        for _ in range(7):
            toks += eng.decode(["a"])[0].token_ids
        outs.append(toks)
    assert outs[0] == outs[1] and len(outs[0]) == 8
