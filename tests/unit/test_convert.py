"""End-to-end converter on a tiny random Llama: output loads and runs, resume skips finished layers, errors."""

from __future__ import annotations

import json

import pytest
import torch

from exl2_backend.errors import ConfigError, ModelDirectoryError, ModelFormatError, UnsupportedModelError
from exl2_backend.format.config import ModelConfig
from exl2_backend.format.qtensor import QTensor
from exl2_backend.format.reader import load_weights
from exl2_backend.format.safetensors_io import ShardIndex
from exl2_backend.model import LlamaModel
from exl2_backend.quant.convert import ConvertSettings, convert
from exl2_backend.quant.optimize import BudgetError
from exl2_backend.runtime.model_runner import ModelRunner
from tests.helpers.synth import tiny_config_dict, write_tiny_exl2_model, write_tiny_fp16_model

TEXTS = [
    ("The river runs past the old mill, where the miller once ground wheat for the whole valley. In spring the "
    "water rises and the wheel turns faster; in late summer it slows to a crawl and the children wade across."),
    ("A compiler translates source code into machine instructions. It parses the text, builds a syntax tree, "
    "checks types, optimizes the intermediate form and finally emits code for the target processor."),
]
FAST = {"rows": 4, "length": 48, "measure_rows": 2, "attn_options": [0, 4, 6, 9, 14, 18],
        "mlp_options": [0, 4, 7, 9, 13, 16], "progress": False, "checkpoint_s": 0.0}


def _settings(tmp_path, name, **kw) -> ConvertSettings:
    return ConvertSettings(**{**FAST, "work_dir": str(tmp_path / f"{name}.work"), **kw})


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("convert")
    src = write_tiny_fp16_model(tmp / "fp16", tiny_config_dict(), seed=3)
    summary = convert(src, tmp / "exl2", _settings(tmp, "full", bpw=4.0), texts=TEXTS)
    return tmp, src, tmp / "exl2", summary


def _tensors(d):
    idx = ShardIndex(d)
    try:
        return {k: idx.get(k).clone() for k in idx.keys()}  # noqa: SIM118 (ShardIndex is not a dict)
    finally:
        idx.close()


def test_output_loads_runs_and_meets_budget(converted):
    _, src, out, summary = converted
    assert summary["achieved_bpw"] <= 4.0 and summary["resumed_layers"] == 0
    cfg = ModelConfig.from_dir(out)
    assert cfg.quantization["bits"] == 4.0 and cfg.quantization["head_bits"] == 6
    assert cfg.quantization["calibration"]["rows"] == 4
    w = load_weights(out, cfg)
    lw = w.layers[1]
    assert all(isinstance(getattr(lw, p), QTensor) for p in ("q_proj", "o_proj", "gate_proj", "down_proj"))
    assert isinstance(w.lm_head, QTensor)
    # q/k/v share one Hessian, hence one act-order permutation (and gate/up likewise)
    assert torch.equal(lw.q_proj.q_invperm, lw.k_proj.q_invperm)
    assert torch.equal(lw.q_proj.q_invperm, lw.v_proj.q_invperm)
    assert torch.equal(lw.gate_proj.q_invperm, lw.up_proj.q_invperm)
    assert (out / "tokenizer.json").is_file() and (out / "measurement.json").is_file()
    meas = json.loads((out / "measurement.json").read_text())
    assert len(meas["measurement"]["model.layers.0.self_attn"]) == 6 and meas["last_module_idx"] == 1

    ids = [[5, 80, 33, 120, 7, 64, 99, 1, 250, 17, 42, 3]]
    logits = {}
    for name, d in (("fp16", src), ("exl2", out)):
        model = LlamaModel.from_dir(d, "cpu")
        logits[name] = ModelRunner(model, model.make_cache(3, 8), 2).run(ids, [0], [[1, 2]], logits="all")
    ref, q = logits["fp16"], logits["exl2"]
    assert torch.isfinite(q).all()
    assert float((q - ref).norm() / ref.norm()) < 0.4  # random weights: errors are not small


def test_resume_after_interruption_skips_finished_layers(converted, tmp_path):
    _, src, full_out, _ = converted
    out = tmp_path / "exl2"
    s = _settings(tmp_path, "resume", bpw=4.0)

    def stop(i):
        raise KeyboardInterrupt  # simulated ^C after layer 0 is saved

    with pytest.raises(KeyboardInterrupt):
        convert(src, out, s, texts=TEXTS, on_layer_done=stop)
    assert not out.exists()
    layer0 = tmp_path / "resume.work" / "layers" / "0.safetensors"
    mtime = layer0.stat().st_mtime_ns
    summary = convert(src, out, s, texts=TEXTS)
    assert summary["resumed_layers"] == 1 and layer0.stat().st_mtime_ns == mtime
    a, b = _tensors(full_out), _tensors(out)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)  # same as an uninterrupted run


def test_reuse_measurement_and_cli(converted, tmp_path):
    from exl2_backend.cli.main import main

    _, src, out, _ = converted
    cal = tmp_path / "cal.txt"
    cal.write_text("\n\n".join(TEXTS))
    rc = main(["convert", str(src), str(tmp_path / "q3"), "--bpw", "3.0", "--head-bits", "4", "--measurement",
               str(out / "measurement.json"), "--rows", "2", "--length", "32", "--cal", str(cal), "--no-progress"])
    assert rc == 0
    cfg = ModelConfig.from_dir(tmp_path / "q3")
    assert cfg.quantization["bits"] == 3.0 and cfg.quantization["head_bits"] == 4
    summary = json.loads((tmp_path / "q3.work" / "summary.json").read_text())
    assert summary["achieved_bpw"] <= 3.0 and summary["timings"]["measure_s"] < 5


def test_errors(converted, tmp_path):
    _, src, out, _ = converted
    meas = str(out / "measurement.json")
    with pytest.raises(BudgetError):
        convert(src, tmp_path / "a", _settings(tmp_path, "a", bpw=1.0, measurement=meas), texts=TEXTS)
    with pytest.raises(BudgetError):
        convert(src, tmp_path / "b", _settings(tmp_path, "b", bpw=9.5, measurement=meas), texts=TEXTS)
    with pytest.raises(BudgetError):  # checked against the option tables before any measuring
        convert(src, tmp_path / "f", _settings(tmp_path, "f", bpw=1.5), texts=TEXTS)
    (tmp_path / "bad.json").write_text("{}")
    with pytest.raises(ModelFormatError, match="measurement"):
        convert(src, tmp_path / "g", _settings(tmp_path, "g", measurement=str(tmp_path / "bad.json")), texts=TEXTS)
    with pytest.raises(ModelDirectoryError):
        convert(tmp_path / "nope", tmp_path / "c", _settings(tmp_path, "c"), texts=TEXTS)
    with pytest.raises(UnsupportedModelError):
        convert(_bad_arch(tmp_path), tmp_path / "d", _settings(tmp_path, "d"), texts=TEXTS)
    with pytest.raises(ModelFormatError, match="already quantized"):
        convert(write_tiny_exl2_model(tmp_path / "q", tiny_config_dict()), tmp_path / "e", _settings(tmp_path, "e"),
                texts=TEXTS)
    # a one-token row has nothing to score (the calibration ppl was nan); past the model's 512 positions the
    # calibration runs where the model never ran; a shard of 0 MB
    for name, fields, field in (("l1", {"length": 1}, "length"), ("l2", {"length": 513}, "length"),
                                ("s0", {"shard_mb": 0}, "shard_mb")):
        with pytest.raises(ConfigError) as e:
            convert(src, tmp_path / name, _settings(tmp_path, name, **fields), texts=TEXTS)
        assert e.value.field == field and not (tmp_path / name).exists()


def _bad_arch(tmp_path):
    d = tmp_path / "gpt2"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({**tiny_config_dict(), "architectures": ["GPT2LMHeadModel"]}))
    return d


def test_converter_output_has_the_format_exllamav2_loaded(converted, tmp_path):
    """ExLlamaV2 0.3.2 loaded directories from format.random_model on the H200 (llama3-8b shape, 2026-12-01: its
    logits matched ours, mean KL 0.0048). The converter's output at the same config has exactly that file
    format: the same tensor names, dtypes, option-independent shapes and per-linear shape rules, and the same
    quantization_config fields."""
    from exl2_backend.format.random_model import write_random_exl2_model

    _, _, out, _ = converted
    loaded = write_random_exl2_model(tmp_path / "random", tiny_config_dict())
    ours, theirs = _tensors(out), _tensors(loaded)
    assert sorted(ours) == sorted(theirs)
    for key, t in ours.items():
        r = theirs[key]
        assert t.dtype == r.dtype, key
        suffix = key.rsplit(".", 1)[1]
        if suffix in ("weight", "q_invperm"):  # FP16 tensors and the permutation: fixed by the config
            assert t.shape == r.shape, key
        elif suffix == "q_weight":  # [packed rows, N]: the rows depend on the chosen bit widths
            assert t.shape[1] == r.shape[1], key
        elif suffix in ("q_scale", "q_scale_max", "q_groups"):  # one entry (q_groups: two) per group
            groups = ours[key.rsplit(".", 1)[0] + ".q_scale_max"].shape[0]
            assert t.shape[0] == (2 * groups if suffix == "q_groups" else groups), key
            assert t.shape[1:] == r.shape[1:], key  # q_scale: [G, N / 8] packed 4-bit codes
    q_ours = json.loads((out / "config.json").read_text())["quantization_config"]
    q_theirs = json.loads((loaded / "config.json").read_text())["quantization_config"]
    assert set(q_theirs) <= set(q_ours) and q_ours["quant_method"] == q_theirs["quant_method"] == "exl2"


# --- found by fuzzing (session 25): each of these converted silently into a wrong or destroyed model ----------


def test_output_that_holds_or_is_inside_the_input_is_refused_before_any_work(converted, tmp_path):
    """An output dir that was an ancestor of the input replaced it atomically, deleting the input; one inside
    it littered the source model; a file or another model as output was refused only after the whole run."""
    import shutil

    _, src, _, _ = converted
    parent = tmp_path / "p"
    shutil.copytree(src, parent / "src")
    (parent / "config.json").write_text((src / "config.json").read_text())
    other = tmp_path / "other_fp16"
    shutil.copytree(src, other)
    (tmp_path / "afile").write_text("x")
    for out, says in ((parent, "must not be, contain or lie inside"), (parent / "src" / "sub", "lie inside"),
                      (tmp_path / "afile", "not a directory"), (other, "not an earlier EXL2 output")):
        with pytest.raises(ModelDirectoryError, match=says):
            convert(parent / "src" if out != other and out != tmp_path / "afile" else src, out,
                    _settings(tmp_path, "x", uniform="4:1@128"), texts=TEXTS)
    assert (parent / "src" / "config.json").is_file() and (other / "config.json").is_file()


def test_measurement_of_another_model_or_with_bad_accuracy_is_refused(converted, tmp_path):
    """A measurement of another model recorded other bit counts (a "2.0 bpw" conversion came out at 7.7 bpw);
    NaN, negative or boolean accuracies made the optimizer pick the cheapest options. Both refused."""
    _, src, out, _ = converted
    meas = json.loads((out / "measurement.json").read_text())
    key = "model.layers.0.self_attn"
    for change, says in ((lambda m: m["measurement"][key][0].update(total_bits=m["measurement"][key][0]["total_bits"]
                                                                    * 4), "bits where its options cost"),
                         (lambda m: m["measurement"][key][1].update(accuracy=float("nan")), "accuracy"),
                         (lambda m: m["measurement"][key][1].update(accuracy=-0.5), "accuracy"),
                         (lambda m: m["measurement"][key][1].update(accuracy=True), "accuracy"),
                         (lambda m: m["measurement"][key][0].pop("q_proj"), "options are invalid"),
                         (lambda m: m["measurement"].update({"model.layers.99.mlp": []}), "blocks this model lacks")):
        bad = json.loads(json.dumps(meas))
        change(bad)
        path = tmp_path / "m.json"
        path.write_text(json.dumps(bad))
        with pytest.raises(ModelFormatError, match=says):
            convert(src, tmp_path / "q", _settings(tmp_path, "q", bpw=3.0, measurement=str(path)), texts=TEXTS)


def test_resume_after_the_source_weights_changed_starts_again(tmp_path):
    """The resume fingerprints held the input's path and config but not its weights: a rerun after new
    weights were written reused the old quantized layers. They now include the shards' sizes and times."""
    src = write_tiny_fp16_model(tmp_path / "src", tiny_config_dict(), seed=1)
    settings = _settings(tmp_path, "job", uniform="4:1@128")
    convert(src, tmp_path / "a", settings, texts=TEXTS)
    first = _tensors(tmp_path / "a")
    write_tiny_fp16_model(tmp_path / "src", tiny_config_dict(), seed=2)  # new weights, same path and config
    summary = convert(src, tmp_path / "a", settings, texts=TEXTS)
    assert summary["resumed_layers"] == 0
    again = _tensors(tmp_path / "a")
    fresh = convert(src, tmp_path / "b", _settings(tmp_path, "fresh", uniform="4:1@128"), texts=TEXTS)
    assert fresh is not None
    q = "model.layers.0.self_attn.q_proj.q_weight"
    assert not torch.equal(again[q], first[q]) and torch.equal(again[q], _tensors(tmp_path / "b")[q])
