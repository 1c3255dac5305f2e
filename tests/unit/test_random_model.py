"""write_random_exl2_model: valid, loadable directories with mixed widths near the target bpw."""

from __future__ import annotations

import pytest
import torch

from exl2_backend.format.config import ModelConfig
from exl2_backend.format.inspect import describe_model
from exl2_backend.format.layout import ATTENTION_OPTIONS, MLP_OPTIONS
from exl2_backend.format.packing import unpack_columns
from exl2_backend.format.qtensor import QTensor
from exl2_backend.format.random_model import SHAPES, choose_options, estimate_bytes, write_random_exl2_model
from exl2_backend.format.reader import ATTN_PROJS, MLP_PROJS, linear_shape, load_weights

SMALL = {"hidden_size": 256, "num_hidden_layers": 2, "intermediate_size": 512, "num_attention_heads": 4,
         "num_key_value_heads": 2, "vocab_size": 1000}


def _decoder_stats(weights) -> tuple[float, set[int]]:
    bits = numel = 0.0
    widths: set[int] = set()
    for layer in weights.layers:
        for proj in ATTN_PROJS + MLP_PROJS:
            qt = getattr(layer, proj)
            assert isinstance(qt, QTensor)
            size = qt.in_features * qt.padded_out_features
            bits += qt.bits_per_weight() * size
            numel += size
            widths |= {g.bits for g in qt.groups}
    return bits / numel, widths


@pytest.mark.parametrize("bpw", [3.0, 4.0, 5.0])
def test_small_shape_loads_and_hits_target(tmp_path, bpw):
    d = write_random_exl2_model(tmp_path / "m", SMALL, bpw=bpw, head_bits=6, seed=1)
    cfg = ModelConfig.from_dir(d)
    assert cfg.hidden_size == 256 and cfg.vocab_size == 1000 and cfg.quantization["bits"] == bpw
    w = load_weights(d, cfg)  # validates every tensor against the config
    avg, widths = _decoder_stats(w)
    assert abs(avg - bpw) <= 0.15, avg
    assert len(widths) >= 2
    assert isinstance(w.lm_head, QTensor) and {g.bits for g in w.lm_head.groups} == {8, 6}
    assert describe_model(d)["decoder_bpw"] == pytest.approx(avg)


def test_padded_head_columns_hold_the_zero_point(tmp_path):
    d = write_random_exl2_model(tmp_path / "m", SMALL, bpw=4.0, seed=0)
    head = load_weights(d, ModelConfig.from_dir(d)).lm_head
    assert head.padded_out_features == 1024
    for g in head.groups:
        q = unpack_columns(head.q_weight[g.qrow_start : g.qrow_start + g.rows * g.bits // 32], g.bits)
        assert (q[:, 1000:] == 1 << (g.bits - 1)).all()
    assert torch.isfinite(head.q_scale_max).all()


def test_sharding_seed_and_tokenizer(tmp_path):
    a = write_random_exl2_model(tmp_path / "a", SMALL, seed=5, shard_mb=0.5)
    b = write_random_exl2_model(tmp_path / "b", SMALL, seed=5)
    assert len(list(a.glob("output-*-of-*.safetensors"))) > 1
    wa = load_weights(a, ModelConfig.from_dir(a))
    wb = load_weights(b, ModelConfig.from_dir(b))
    assert torch.equal(wa.layers[1].down_proj.q_weight, wb.layers[1].down_proj.q_weight)  # deterministic
    assert torch.equal(wa.embed_tokens, wb.embed_tokens)

    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(a / "tokenizer.json"))
    cfg = ModelConfig.from_dir(a)
    ids = tok.encode("Hello the world, and ünïcode!").ids
    assert ids[0] == cfg.bos_token_id and max(ids) < cfg.vocab_size
    assert tok.decode(ids, skip_special_tokens=True) == "Hello the world, and ünïcode!"
    assert cfg.eos_token_ids == (tok.token_to_id("<|end_of_text|>"),)


def test_tokenizer_from_copies_files(tmp_path):
    src = write_random_exl2_model(tmp_path / "src", SMALL, seed=0)
    d = write_random_exl2_model(tmp_path / "d", SMALL, seed=0, tokenizer_from=src)
    assert (d / "tokenizer.json").read_bytes() == (src / "tokenizer.json").read_bytes()


@pytest.mark.parametrize("name", sorted(SHAPES))
def test_real_shapes_option_choice(name):
    cfg = ModelConfig.from_dict({"architectures": ["LlamaForCausalLM"], "rms_norm_eps": 1e-5, **SHAPES[name]})
    assert cfg.rope_scaling.rope_type == "llama3" and cfg.rope_theta == 500000.0
    assert cfg.max_position_embeddings == 131072 and cfg.tie_word_embeddings == (name == "llama3-1b")
    for target in (2.5, 4.0, 6.0):
        choice = choose_options(cfg, target)
        assert len(choice) == cfg.num_hidden_layers
        bits = numel = 0
        for ai, mi in choice:
            for opt, proj in zip(ATTENTION_OPTIONS[ai] + MLP_OPTIONS[mi], ATTN_PROJS + MLP_PROJS):
                k, n = linear_shape(cfg, proj)
                bits += opt.total_bits(k, n)
                numel += k * n
        assert target - 0.05 <= bits / numel <= target + 1e-9
        assert len(set(choice)) >= 2  # mixed options across layers


def test_llama3_8b_size_matches_the_format_doc():
    # format doc c: 4.96 GB for Llama-3.1-8B at 4.0 bpw / head 6 (1.05 embeddings + 0.42 head + 3.49 decoder)
    assert estimate_bytes("llama3-8b", 4.0, 6) / 1e9 == pytest.approx(4.96, rel=0.01)
