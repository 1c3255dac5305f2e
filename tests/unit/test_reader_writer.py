"""write_model_dir -> ShardIndex / load_weights round trips, sharding, atomicity, tokenizer copies, inspect."""

from __future__ import annotations

import json
import re

import pytest
import torch
from safetensors.torch import load_file

from exl2_backend.errors import ModelDirectoryError, ModelFormatError
from exl2_backend.format import writer
from exl2_backend.format.config import ModelConfig
from exl2_backend.format.inspect import describe_model
from exl2_backend.format.qtensor import QTensor
from exl2_backend.format.reader import DenseLinear, iter_linear_keys, load_weights
from exl2_backend.format.safetensors_io import ShardIndex
from exl2_backend.format.writer import make_quantization_config, qtensor_tensors, write_model_dir
from tests.helpers.synth import random_qtensor, tiny_config_dict, write_tiny_exl2_model, write_tiny_fp16_model


def _all_tensors(d) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(d.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def test_qtensor_tensors_and_round_trip(tmp_path):
    qt = random_qtensor("model.layers.0.mlp.down_proj", 160, 40, "6:0.05@32 3:0.2@64 2:0.75@64", seed=1, bias=True)
    t = qtensor_tensors(qt)
    assert list(t) == [f"{qt.key}.{n}" for n in ("q_weight", "q_scale", "q_scale_max", "q_groups", "q_invperm", "bias")]
    write_model_dir(tmp_path / "m", tiny_config_dict(), t)
    back = _all_tensors(tmp_path / "m")
    assert all(torch.equal(back[n], v) and back[n].dtype == v.dtype for n, v in t.items())


def test_tiny_exl2_round_trip_multiple_shards(tmp_path):
    cfg_dict = tiny_config_dict()
    d = write_tiny_exl2_model(tmp_path / "one", cfg_dict, seed=3)
    sharded = write_tiny_exl2_model(tmp_path / "many", cfg_dict, seed=3, shard_mb=0.05)
    names = sorted(p.name for p in sharded.glob("*.safetensors"))
    n = len(names)
    assert n > 2 and names == [f"output-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]
    assert [p.name for p in d.glob("*.safetensors")] == ["output.safetensors"]
    one, many = _all_tensors(d), _all_tensors(sharded)
    assert one.keys() == many.keys() and all(torch.equal(one[k], many[k]) for k in one)
    assert all(t.dtype in (torch.int32, torch.int16, torch.float16) for t in one.values())

    written = json.loads((sharded / "config.json").read_text())
    assert written["quantization_config"]["quant_method"] == "exl2"
    assert written["quantization_config"]["head_bits"] == 6 and "version" in written["quantization_config"]
    cfg = ModelConfig.from_dir(sharded)
    assert cfg == ModelConfig.from_dict({**cfg_dict, "quantization_config": written["quantization_config"]})
    assert cfg.quantization["bits"] == 4.0

    w = load_weights(sharded, cfg)
    assert len(w.layers) == 2 and w.embed_tokens.shape == (300, 128) and w.embed_tokens.dtype == torch.float16
    assert isinstance(w.lm_head, QTensor) and w.lm_head.padded_out_features == 320
    q = w.layers[1].down_proj
    assert isinstance(q, QTensor) and q.in_features == 256 and q.out_features == 128
    assert torch.equal(q.q_weight, one["model.layers.1.mlp.down_proj.q_weight"])
    assert torch.equal(w.layers[0].q_proj.q_invperm, w.layers[0].k_proj.q_invperm)  # shared act-order perms
    assert torch.equal(w.layers[0].gate_proj.q_invperm, w.layers[0].up_proj.q_invperm)


def test_qwen2_biases_load(tmp_path):
    d = write_tiny_exl2_model(tmp_path / "q", tiny_config_dict("Qwen2ForCausalLM"), seed=0)
    w = load_weights(d, ModelConfig.from_dir(d))
    layer = w.layers[0]
    assert all(getattr(layer, p).bias is not None for p in ("q_proj", "k_proj", "v_proj"))
    assert layer.o_proj.bias is None and layer.q_proj.bias.shape == (128,)


def test_fp16_model_loads_dense_and_tied(tmp_path):
    cfg_dict = tiny_config_dict(tie_word_embeddings=True)
    d = write_tiny_fp16_model(tmp_path / "f", cfg_dict, seed=0)
    w = load_weights(d, ModelConfig.from_dir(d))
    assert w.lm_head is None
    lin = w.layers[0].gate_proj
    assert isinstance(lin, DenseLinear) and lin.weight.shape == (256, 128) and lin.weight.dtype == torch.float16
    assert (d / "tokenizer.json").is_file()


def test_bf16_and_f32_are_converted(tmp_path):
    cfg_dict = tiny_config_dict()
    d = write_tiny_fp16_model(tmp_path / "f", cfg_dict, seed=0)
    t = _all_tensors(d)
    t["model.norm.weight"] = t["model.norm.weight"].float()
    t["model.layers.0.self_attn.q_proj.weight"] = t["model.layers.0.self_attn.q_proj.weight"].to(torch.bfloat16)
    write_model_dir(tmp_path / "g", cfg_dict, t)
    w = load_weights(tmp_path / "g", ModelConfig.from_dict(cfg_dict))
    assert w.norm.dtype == torch.float16 and w.layers[0].q_proj.weight.dtype == torch.float16


def test_copy_from_copies_only_tokenizer_files(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json", "special_tokens_map.json"):
        (src / name).write_text("{}")
    (src / "model.safetensors.index.json").write_text("{}")
    (src / "model.safetensors").write_bytes(b"junk")
    write_model_dir(tmp_path / "out", tiny_config_dict(), {"x": torch.zeros(2, dtype=torch.float16)}, copy_from=src)
    names = sorted(p.name for p in (tmp_path / "out").iterdir())
    assert names == ["config.json", "generation_config.json", "output.safetensors", "special_tokens_map.json",
                     "tokenizer.json", "tokenizer_config.json"]


def test_dtype_rules(tmp_path):
    t = {"a.q_invperm": torch.arange(32, dtype=torch.int64)}
    write_model_dir(tmp_path / "ok", {}, t)
    assert ShardIndex(tmp_path / "ok").info("a.q_invperm").dtype == "I32"
    with pytest.raises(ModelFormatError) as e:
        write_model_dir(tmp_path / "bad", {}, {"a.weight": torch.zeros(2, dtype=torch.int64)})
    assert e.value.tensor == "a.weight"
    assert not (tmp_path / "bad").exists()


def test_write_is_atomic(tmp_path, monkeypatch):
    out = tmp_path / "m"
    write_model_dir(out, {"v": 1}, {"x": torch.zeros(2, dtype=torch.float16)})

    def boom(*args, **kwargs):
        raise RuntimeError("interrupted")

    monkeypatch.setattr(writer, "write_config", boom)  # fails after the shards are written
    with pytest.raises(RuntimeError):
        write_model_dir(out, {"v": 2}, {"y": torch.zeros(2, dtype=torch.float16)})
    monkeypatch.undo()
    assert json.loads((out / "config.json").read_text()) == {"v": 1}  # old directory untouched
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m"]  # no temp leftovers
    write_model_dir(out, {"v": 3}, {"z": torch.ones(2, dtype=torch.float16)})  # replacing a model dir is fine
    assert ShardIndex(out).keys() == ["z"]


def test_refuses_to_replace_a_non_model_directory(tmp_path):
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "notes.txt").write_text("mine")
    with pytest.raises(ModelDirectoryError):
        write_model_dir(tmp_path / "d", {}, {"x": torch.zeros(2, dtype=torch.float16)})
    assert (tmp_path / "d" / "notes.txt").read_text() == "mine"


def test_quantization_config_helper():
    q = make_quantization_config(4.0, 6, {"rows": 115, "length": 2048, "dataset": "(default)"})
    assert q["quant_method"] == "exl2" and q["bits"] == 4.0 and q["head_bits"] == 6
    assert re.match(r"\d+\.\d+", q["version"])


def test_iter_linear_keys():
    cfg = ModelConfig.from_dict(tiny_config_dict())
    keys = list(iter_linear_keys(cfg))
    assert len(keys) == 2 * 7 + 1 and keys[-1] == ("lm_head", "lm_head")
    assert keys[0] == ("model.layers.0.self_attn.q_proj", "q_proj")
    assert keys[6] == ("model.layers.0.mlp.down_proj", "down_proj")


def test_describe_model(tmp_path):
    d = write_tiny_exl2_model(tmp_path / "m", tiny_config_dict(), seed=0)
    info = describe_model(d)
    assert info["architecture"] == "LlamaForCausalLM" and info["num_layers"] == 2
    assert len(info["linears"]) == 14 and info["head"]["format"] == "exl2" and not info["head"]["tied"]
    assert info["head"]["bits"] == {8: 128}  # K=128 with 8:0.15@128: one group covers all rows
    assert 2.0 < info["decoder_bpw"] < 8.5 and info["head_bits"] == 6
    hist = info["layers"][0]["bit_histogram"]
    assert sum(hist.values()) == pytest.approx(1.0) and len(hist) >= 2
    assert info["memory"]["kv_cache_bytes_per_token"] == 2 * 2 * 2 * 32 * 2
    assert info["file_bytes"] >= info["memory"]["weights_bytes"] > 0
    assert info["parameters"]["total"] > info["parameters"]["decoder"] > 0
    json.dumps(info)  # JSON-able for the CLI
    assert info["missing_tensors"] == []


def test_info_names_missing_tensors_and_exits_1(tmp_path, capsys):
    """`info` describes a directory that lacks tensors a load needs, names them and exits 1 (it once exited 0,
    showing a missing linear as 0 bpw); the complete directory exits 0."""
    from safetensors.torch import save_file

    from exl2_backend.cli.main import main

    d = write_tiny_exl2_model(tmp_path / "m", tiny_config_dict(), seed=0)
    assert main(["info", str(d), "--device", "cpu", "--json"]) == 0
    capsys.readouterr()
    (shard,) = d.glob("*.safetensors")  # one shard at this size
    tensors = {k: v for k, v in load_file(shard).items()
               if not k.startswith(("model.layers.1.mlp.up_proj.", "lm_head.")) and k != "model.norm.weight"}
    save_file(tensors, shard, metadata={"format": "pt"})
    assert main(["info", str(d), "--device", "cpu", "--json"]) == 1
    missing = json.loads(capsys.readouterr().out)["missing_tensors"]
    assert missing == ["model.norm.weight", "model.layers.1.mlp.up_proj (q_weight or weight)",
                       "lm_head (q_weight or weight; tie_word_embeddings is false)"]
    assert main(["info", str(d), "--device", "cpu"]) == 1
    assert "will not load" in capsys.readouterr().out


def test_info_says_when_the_tokens_that_fit_pass_the_positions(tmp_path, capsys):
    """The cache types' table counts the tokens that fit the VRAM budget; where that passes the model's positions
    (a tiny model in 24 GiB), a caption says one sequence is held to them, so it is not read as a context length."""
    from exl2_backend.cli.main import main

    cfg = tiny_config_dict()
    d = write_tiny_exl2_model(tmp_path / "m", cfg, seed=0)
    assert main(["info", str(d), "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert "tokens that fit" in out
    assert f"held to the model's {cfg['max_position_embeddings']:,} positions" in " ".join(out.split())


def test_info_tables_are_whole_off_a_terminal(tmp_path, capsys, monkeypatch):
    """Piped or logged (no terminal), rich printed 80 columns and cut the memory plan's ten columns to "devi…" and
    "weig…"; the CLI's tables now take 200 columns there, unless COLUMNS says otherwise."""
    from exl2_backend.cli.main import main

    monkeypatch.delenv("COLUMNS", raising=False)
    d = write_tiny_exl2_model(tmp_path / "m", tiny_config_dict(), seed=0)
    assert main(["info", str(d), "--device", "cuda", "--gpu-split", "0.01,0.01"]) == 1  # a plan that does not fit
    out = capsys.readouterr().out
    assert "…" not in out, out
    for column in ("device", "layers", "weights GB", "KV cache GB", "peak GB", "budget GB"):
        assert column in out
    assert "does not fit: cuda:0 needs" in out
