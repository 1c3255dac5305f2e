"""Broken model directories: each fails with one typed error that names the file and tensor (or field)."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from exl2_backend.errors import (
    ConfigError,
    CorruptFileError,
    MissingTensorError,
    ModelDirectoryError,
    ModelFormatError,
    NonFiniteScaleError,
    TensorShapeError,
    UnsupportedBitWidthError,
    UnsupportedModelError,
)
from exl2_backend.format.config import SUPPORTED_ARCHITECTURES, ModelConfig
from exl2_backend.format.reader import load_weights
from tests.helpers.synth import tiny_config_dict, write_tiny_exl2_model, write_tiny_fp16_model

Q = "model.layers.0.self_attn.q_proj"  # option "3:0.05@64 2:0.95@64" on K=128: q_groups [3, 0, 2, 6]


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    return write_tiny_exl2_model(tmp_path_factory.mktemp("base") / "m", tiny_config_dict(), seed=0)


@pytest.fixture
def model(base, tmp_path):
    d = tmp_path / "m"
    shutil.copytree(base, d)
    return d


def _shard(d):
    return d / "output.safetensors"


def _mutate(d, fn):
    t = load_file(str(_shard(d)))
    fn(t)
    save_file(t, str(_shard(d)))


def _load(d):
    return load_weights(d, ModelConfig.from_dir(d))


def _expect(d, exc, tensor):
    with pytest.raises(exc) as e:
        _load(d)
    assert e.value.tensor == tensor, str(e.value)
    assert e.value.path is not None and str(e.value.path) in str(e.value) and tensor in str(e.value)
    return e.value


def test_base_model_is_valid(base):
    _load(base)
    assert load_file(str(_shard(base)))[f"{Q}.q_groups"].tolist() == [3, 0, 2, 6]


def test_truncated_file(model):
    data = _shard(model).read_bytes()
    _shard(model).write_bytes(data[:-100])
    with pytest.raises(CorruptFileError) as e:
        _load(model)
    assert e.value.path == str(_shard(model)) and e.value.tensor is not None and "truncated" in str(e.value)


def test_garbage_header(model):
    _shard(model).write_bytes((40).to_bytes(8, "little") + b"\x89PNG garbage garbage garbage garbage!!" + b"\0" * 64)
    with pytest.raises(CorruptFileError) as e:
        _load(model)
    assert e.value.path == str(_shard(model)) and "JSON" in str(e.value)


def test_header_length_beyond_file(model):
    data = bytearray(_shard(model).read_bytes())
    data[:8] = (len(data) * 2).to_bytes(8, "little")
    _shard(model).write_bytes(bytes(data))
    with pytest.raises(CorruptFileError) as e:
        _load(model)
    assert e.value.path == str(_shard(model)) and "exceeds" in str(e.value)


@pytest.mark.parametrize("name", [f"{Q}.q_scale", "model.layers.1.mlp.up_proj.q_invperm", "model.norm.weight",
                                  "model.embed_tokens.weight"])
def test_missing_tensor(model, name):
    _mutate(model, lambda t: t.pop(name))
    e = _expect(model, MissingTensorError, name)
    assert e.path == str(model)


def test_missing_linear_and_head(model):
    _mutate(model, lambda t: [t.pop(k) for k in list(t) if k.startswith("lm_head.")])
    _expect(model, MissingTensorError, "lm_head.weight")


@pytest.mark.parametrize("name,fn", [
    ("q_weight", lambda x: x[:, :-32]),  # wrong padded width
    ("q_scale", lambda x: x[:, :-1]),
    ("q_scale_max", lambda x: x[:-1]),
    ("q_invperm", lambda x: x[:-32]),
    ("q_invperm", lambda x: torch.zeros_like(x)),  # not a permutation
    ("q_scale_max", lambda x: x.float()),  # wrong dtype
])
def test_misshaped_exl2_tensors(model, name, fn):
    def mutate(t):
        t[f"{Q}.{name}"] = fn(t[f"{Q}.{name}"]).contiguous()

    _mutate(model, mutate)
    _expect(model, TensorShapeError, f"{Q}.{name}")


def test_in_features_mismatch(model):
    def mutate(t):  # swap q_proj for down_proj's tensors (K = 256 instead of 128, same N)
        for n in ("q_weight", "q_scale", "q_scale_max", "q_groups", "q_invperm"):
            t[f"{Q}.{n}"] = t[f"model.layers.0.mlp.down_proj.{n}"].clone()

    _mutate(model, mutate)
    _expect(model, TensorShapeError, f"{Q}.q_groups")


def test_nan_scale_max(model):
    def mutate(t):
        t[f"{Q}.q_scale_max"][1] = float("nan")

    _mutate(model, mutate)
    _expect(model, NonFiniteScaleError, f"{Q}.q_scale_max")


@pytest.mark.parametrize("groups", [[7, 0, 2, 6], [2, 0, 3, 4]])  # width 7; widths increasing (2 then 3)
def test_bad_group_widths(model, groups):
    def mutate(t):
        t[f"{Q}.q_groups"] = torch.tensor(groups, dtype=torch.int16)

    _mutate(model, mutate)
    _expect(model, UnsupportedBitWidthError, f"{Q}.q_groups")


def test_embedding_and_dense_shapes(tmp_path):
    d = write_tiny_fp16_model(tmp_path / "f", tiny_config_dict(), seed=0)
    t = load_file(str(_shard(d)))
    t["model.layers.0.mlp.gate_proj.weight"] = t["model.layers.0.mlp.gate_proj.weight"][:, :64].contiguous()
    save_file(t, str(_shard(d)))
    _expect(d, TensorShapeError, "model.layers.0.mlp.gate_proj.weight")
    t["model.layers.0.mlp.gate_proj.weight"] = torch.zeros(256, 128, dtype=torch.float16)
    t["model.embed_tokens.weight"] = t["model.embed_tokens.weight"][:299].contiguous()
    save_file(t, str(_shard(d)))
    _expect(d, TensorShapeError, "model.embed_tokens.weight")


def test_unexpected_bias(model):
    def mutate(t):
        t["model.layers.0.self_attn.o_proj.bias"] = torch.zeros(128, dtype=torch.float16)

    _mutate(model, mutate)
    e = _expect(model, ModelFormatError, "model.layers.0.self_attn.o_proj.bias")
    assert "does not expect" in str(e)


def test_missing_expected_bias(model):
    cfg = json.loads((model / "config.json").read_text())
    cfg["architectures"] = ["Qwen2ForCausalLM"]
    (model / "config.json").write_text(json.dumps(cfg))
    e = _expect(model, ModelFormatError, f"{Q}.bias")
    assert "expects" in str(e)


@pytest.mark.parametrize("field", ["rms_norm_eps", "hidden_size"])
def test_config_missing_field(model, field):
    cfg = json.loads((model / "config.json").read_text())
    del cfg[field]
    (model / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError) as e:
        ModelConfig.from_dir(model)
    assert e.value.field == field and str(model / "config.json") in str(e.value)


def test_config_invalid_json(model):
    (model / "config.json").write_text('{"hidden_size": 128,')
    with pytest.raises(ConfigError) as e:
        ModelConfig.from_dir(model)
    assert e.value.path == str(model / "config.json")


def test_unsupported_architecture(model):
    cfg = json.loads((model / "config.json").read_text())
    cfg["architectures"] = ["FalconForCausalLM"]
    (model / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedModelError) as e:
        ModelConfig.from_dir(model)
    assert "FalconForCausalLM" in str(e.value) and all(a in str(e.value) for a in SUPPORTED_ARCHITECTURES)


def test_directory_without_config_or_weights(model):
    cfg = ModelConfig.from_dir(model)
    (model / "config.json").unlink()
    with pytest.raises(ModelDirectoryError) as e:
        ModelConfig.from_dir(model)
    assert "config.json" in str(e.value)
    _shard(model).unlink()
    with pytest.raises(ModelDirectoryError) as e:
        load_weights(model, cfg)
    assert e.value.path == str(model)


def test_a_cuda_device_that_is_not_here_is_a_config_error():
    """device="cuda" / "cuda:N" where no such device exists: ConfigError naming `device` when the settings are
    resolved, not torch's AssertionError from inside the model load."""
    import torch

    from exl2_backend.runtime.placement import load_model
    from exl2_backend.runtime.settings import LoadSettings, require_device, resolve_device

    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    with pytest.raises(ConfigError, match=f"cuda:{count}") as e:
        require_device(f"cuda:{count}")
    assert e.value.field == "device"
    assert resolve_device(f"cuda:{count}").index == count  # plans may name another machine's devices
    if count == 0:
        with pytest.raises(ConfigError, match="no CUDA device"):
            load_model(LoadSettings(device="cuda"))


def test_load_setting_errors_give_the_reason_of_a_union_field():
    """ngram is bool | NgramConfig: pydantic fails both members; the error is the NgramConfig check's own
    reason (min_n > max_n), on the field `ngram`, not "Input should be a valid boolean"."""
    from exl2_backend.plugin.impl import _load_settings

    with pytest.raises(ConfigError, match=r"ngram: ngram min_n \(5\) must be <= max_n \(2\)") as e:
        _load_settings({"ngram": {"min_n": 5, "max_n": 2}})
    assert e.value.field == "ngram"


# --- found by fuzzing (session 25): each of these loaded, hung or crashed untyped ----------------------------


def _set_config(d, **fields):
    cfg = json.loads((d / "config.json").read_text())
    cfg.update(fields)
    (d / "config.json").write_text(json.dumps(cfg))


def test_layer_count_must_match_the_shards(model):
    """Fewer layers in config.json than in the shards silently dropped the last ones (wrong output); many more
    (10^9) looped for minutes in the plan and in `info`. Both are refused before anything loops over layers."""
    from exl2_backend.format.inspect import describe_model
    from exl2_backend.plan.sizes import describe_dir

    n = json.loads((model / "config.json").read_text())["num_hidden_layers"]
    for layers, exc, says in ((n - 1, ModelFormatError, f"tensors of layer {n - 1}"),
                              (n + 1, MissingTensorError, f"no tensors of layer {n}"),
                              (10**9, MissingTensorError, f"no tensors of layer {n}")):
        _set_config(model, num_hidden_layers=layers)
        for read in (_load, describe_dir, describe_model):
            with pytest.raises(exc, match=says):
                read(model)


@pytest.mark.parametrize("name, row", [("model.norm.weight", None), ("model.layers.0.input_layernorm.weight", None),
                                       ("model.embed_tokens.weight", 3)])
@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_non_finite_floating_weights_are_refused_at_load(model, name, row, value):
    """A NaN norm or embedding row only showed as NaN logits at the first step (or finite garbage through a
    dense weight): refused at load, naming the tensor."""
    def poison(t):
        (t[name][row] if row is not None else t[name])[0] = value

    _mutate(model, poison)
    _expect(model, NonFiniteScaleError, name)


@pytest.mark.parametrize("value, says", [(-1.0, "negative"), (60000.0, "past fp16")])
def test_q_scale_max_negative_or_overflowing_is_refused(model, value, says):
    """A negative maximum flips a group's weights silently; one so large that code 0 with scale code 15 leaves
    fp16 dequantizes to inf. ExLlamaV2 writes fp16(max |scale|), never either."""
    def poison(t):
        t[f"{Q}.q_scale_max"][0] = value

    _mutate(model, poison)
    with pytest.raises(NonFiniteScaleError, match=says) as e:
        _load(model)
    assert e.value.tensor == f"{Q}.q_scale_max"


def test_shard_paths_that_are_not_files(model):
    """A directory named *.safetensors, a link to nothing, a link loop: CorruptFileError naming the path, not
    IsADirectoryError / FileNotFoundError / OSError."""
    for make in (lambda p: p.mkdir(), lambda p: p.symlink_to(model / "nowhere"), lambda p: p.symlink_to(p)):
        odd = model / "zz.safetensors"
        make(odd)
        with pytest.raises(CorruptFileError) as e:
            _load(model)
        assert e.value.path == str(odd)
        odd.rmdir() if odd.is_dir() and not odd.is_symlink() else odd.unlink()


def test_config_values_that_break_rope_or_generation_config(model):
    for fields, field in (({"rope_theta": 1e-300}, "rope_theta"), ({"rope_theta": 1.0}, "rope_theta"),
                          ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 4.0,
                                             "high_freq_factor": 1.0, "original_max_position_embeddings": 8192}},
                           "rope_scaling.low_freq_factor")):
        cfg = tiny_config_dict(**fields)
        with pytest.raises(ConfigError) as e:
            ModelConfig.from_dict(cfg)
        assert e.value.field == field
    (model / "generation_config.json").write_text("[1]")
    with pytest.raises(ConfigError, match="generation_config.json must be a JSON object"):
        ModelConfig.from_dir(model)


@pytest.mark.parametrize("name", ["config.json", "generation_config.json"])
@pytest.mark.parametrize("odd", ["directory", "dead link"])
def test_a_config_file_that_is_not_a_regular_file_is_named(model, name, odd):
    """A directory or dead link where config.json or generation_config.json belongs: a ConfigError naming it
    (generation_config.json was taken as absent, its EOS ids silently lost, while the tokenizer refused it)."""
    path = model / name
    path.unlink(missing_ok=True)
    if odd == "directory":
        path.mkdir()
    else:
        path.symlink_to(model / "nowhere.json")
    with pytest.raises(ConfigError, match=f"{name} is not a regular file") as e:
        ModelConfig.from_dir(model)
    assert e.value.path == str(path)


def test_eos_outside_the_vocabulary_is_dropped_with_a_warning(model, caplog):
    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    (model / "generation_config.json").write_text(json.dumps({"eos_token_id": [1, vocab + 5]}))
    _set_config(model, eos_token_id=2)
    assert ModelConfig.from_dir(model).eos_token_ids == (2, 1)
    assert f"[{vocab + 5}]" in caplog.text


def test_a_missing_shard_is_named(tmp_path):
    """Shards named <stem>-i-of-n: a missing one is named (it surfaced as "neither ...q_weight nor ...weight
    found" for some tensor it held)."""
    d = write_tiny_exl2_model(tmp_path / "m", tiny_config_dict(), seed=0, shard_mb=0.05)
    shards = sorted(d.glob("*-of-*.safetensors"))
    assert len(shards) >= 3
    shards[1].unlink()
    with pytest.raises(ModelDirectoryError, match=f"shard 2 of {len(shards)} is missing") as e:
        _load(d)
    assert e.value.path.endswith(shards[1].name)


def test_cli_inputs_that_raised_untyped(tmp_path):
    """A binary .jsonl calibration file (UnicodeDecodeError), a work directory through a file
    (NotADirectoryError), a non-loopback serve host (ValueError), a one-token evaluation text (ValueError):
    each is now a typed error the CLI prints as one line."""
    from exl2_backend.errors import Exl2Error, InvalidRequestError
    from exl2_backend.quant.calibration import CalibrationDataError, load_calibration_texts
    from exl2_backend.quant.evaluate import evaluate_models
    from exl2_backend.quant.job import JobState
    from exl2_backend.serve.server import run_server

    (tmp_path / "bin.jsonl").write_bytes(b"\xff\xfe\x00\x01")
    with pytest.raises(CalibrationDataError, match="not UTF-8"):
        load_calibration_texts([str(tmp_path / "bin.jsonl")])
    (tmp_path / "afile").write_text("x")
    with pytest.raises(ModelDirectoryError, match="cannot create the work directory"):
        JobState(tmp_path / "afile" / "work")
    with pytest.raises(ConfigError) as e:
        run_server(None, host="8.8.8.8", port=18123)
    assert e.value.field == "host" and isinstance(e.value, Exl2Error)
    with pytest.raises(ModelDirectoryError):  # checked before LitServe starts a worker
        run_server(str(tmp_path / "no-model"), host="127.0.0.1", port=18123)

    class _Vocab:  # evaluate_models checks vocabulary sizes before the windows
        vocab_size = 10

    with pytest.raises(InvalidRequestError, match="at least 2 tokens"):
        evaluate_models(_Vocab(), _Vocab(), [1], 16, None)
