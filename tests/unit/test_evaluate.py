"""`exl2_backend.quant.evaluate` and `exl2-backend eval`: the default EXL2 model against its FP16 source on a
short held-out text (perplexity finite, KL >= 0, agreement in [0, 1]) and FP16 against itself (KL 0,
agreement 1)."""

from __future__ import annotations

import argparse
import json
import math

import pytest

from exl2_backend.quant.evaluate import _windows, evaluate_models, tokenize_eval_text

MAX_TOKENS = 128
WINDOW = 64


@pytest.fixture(scope="module")
def eval_ids(default_model_dir, default_fp16_dir):
    ids, bos = tokenize_eval_text(default_model_dir, max_tokens=MAX_TOKENS, reference_dir=default_fp16_dir)
    assert len(ids) == MAX_TOKENS
    return ids, bos


@pytest.fixture(scope="module")
def fp16_model(default_fp16_dir):
    from exl2_backend.model import LlamaModel

    return LlamaModel.from_dir(default_fp16_dir, "cpu")


def test_windows():
    ids = list(range(10, 20))
    assert _windows(ids, 4, None) == [[10, 11, 12, 13], [14, 15, 16, 17], [18, 19]]
    assert _windows(ids, 4, 1) == [[1, 10, 11, 12], [1, 13, 14, 15], [1, 16, 17, 18], [1, 19]]
    assert _windows(list(range(9)), 4, None) == [[0, 1, 2, 3], [4, 5, 6, 7]]  # a lone last token: nothing to score
    with pytest.raises(ValueError):
        _windows(ids, 1, None)


def test_exl2_vs_fp16(default_model_dir, fp16_model, eval_ids):
    from exl2_backend.model import LlamaModel

    ids, bos = eval_ids
    model = LlamaModel.from_dir(default_model_dir, "cpu")
    r = evaluate_models(model, fp16_model, ids, window=WINDOW, bos=bos)
    assert r.windows == len(_windows(ids, WINDOW, bos))
    assert r.tokens == sum(len(w) - 1 for w in _windows(ids, WINDOW, bos))
    assert math.isfinite(r.perplexity) and 1.0 < r.perplexity < 1000
    assert math.isfinite(r.reference_perplexity) and 1.0 < r.reference_perplexity < 1000
    assert 0.0 < r.kl_mean < 0.5 and r.kl_max >= r.kl_mean
    assert 0.5 <= r.top1_agreement <= 1.0
    assert 0.0 <= r.top1_accuracy <= 1.0 and 0.0 <= r.reference_top1_accuracy <= 1.0
    json.dumps(r.to_dict())


def test_fp16_vs_itself(fp16_model, eval_ids):
    ids, bos = eval_ids
    # the model is run twice, through two runners and two caches: the same numbers both times
    r = evaluate_models(fp16_model, fp16_model, ids, window=WINDOW, bos=bos)
    assert r.kl_mean < 1e-6 and r.kl_max < 1e-5 and r.top1_agreement == 1.0
    assert r.perplexity == pytest.approx(r.reference_perplexity, rel=1e-6)
    assert r.top1_accuracy == r.reference_top1_accuracy


def test_cli_json(default_fp16_dir, fp16_model, tmp_path, capsys, monkeypatch):
    from exl2_backend.cli import eval_cmd
    from exl2_backend.model import LlamaModel

    loads = []
    monkeypatch.setattr(LlamaModel, "from_dir", lambda d, device="cpu": loads.append(d) or fp16_model)

    text = tmp_path / "t.txt"
    text.write_text("The quick brown fox jumps over the lazy dog. " * 8, encoding="utf-8")
    parser = argparse.ArgumentParser()
    eval_cmd.add_parser(parser.add_subparsers())
    args = parser.parse_args(["eval", str(default_fp16_dir), "--reference", str(default_fp16_dir),
                              "--text", str(text), "--max-tokens", "48", "--window", "32", "--device", "cpu",
                              "--json"])
    assert args.func(args) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["kl_mean"] == 0.0 and out["top1_agreement"] == 1.0
    assert out["meta"]["text_tokens"] == 48 and out["windows"] == 2
    assert math.isfinite(out["perplexity"])
    assert len(loads) == 1  # same directory for model and reference: loaded once


@pytest.mark.parametrize("field, value", [("num_hidden_layers", 7), ("hidden_size", 1024),
                                          ("architecture", "Qwen2ForCausalLM")])
def test_a_reference_of_another_shape_is_refused_before_loading(default_fp16_dir, tmp_path, field, value):
    """KL against another model's distribution says nothing of this one's quantization: a reference whose config
    differs in shape (same vocabulary or not) is a ConfigError naming the field, before either model loads."""
    from exl2_backend.errors import ConfigError
    from exl2_backend.quant.evaluate import evaluate

    cfg = json.loads((default_fp16_dir / "config.json").read_text())
    if field == "architecture":
        cfg["architectures"] = [value]
    else:
        cfg[field] = value
    other = tmp_path / "other"
    other.mkdir()
    (other / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match="the reference is another model") as e:
        evaluate(default_fp16_dir, other, device="cpu")
    assert e.value.field == field and e.value.path == str(other)
