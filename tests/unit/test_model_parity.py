"""LlamaModel vs transformers: tiny random Llama / Mistral / Qwen2 models saved as FP16 safetensors dirs, and
the real SmolLM2 default model (FP16 and EXL2).

Tolerances (all fp32 on CPU, both sides reading the same fp16 weights):
- tiny models: max |ours - transformers| < 1e-4 on every logit (only summation order differs);
- SmolLM2 FP16: max |ours - transformers| < 2e-3 * max |transformers logits|;
- SmolLM2 EXL2 (the converter's 5.0 bpw GPTQ default): our EXL2 logits within 2e-3 * logit scale of transformers
  on the dequantized weights; vs FP16 on an English paragraph: top-1 agreement >= 0.7, EXL2's top-1 in FP16's
  top-5 >= 0.95, mean KL < 0.2 nats.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from exl2_backend.model import LlamaModel
from exl2_backend.runtime.model_runner import ModelRunner

TINY_ATOL = 1e-4
PAGE = 8  # small pages so a 20-token prompt spans several, non-contiguous ones

PARAGRAPH = (
    "The history of the printing press begins in the fifteenth century, when Johannes Gutenberg combined "
    "movable metal type, oil-based ink and a wooden press adapted from those used to make wine. Books, which "
    "had been copied by hand for centuries, could now be produced quickly and cheaply, and within fifty years "
    "presses were operating in more than two hundred cities across Europe."
)


def _tiny_dir(tmp_path, kind: str):
    """A random tiny model of `kind`, saved as FP16 safetensors; returns (dir, transformers fp32 model)."""
    from transformers import (
        LlamaConfig,
        LlamaForCausalLM,
        MistralConfig,
        MistralForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
    )

    common = {"vocab_size": 300, "hidden_size": 64, "intermediate_size": 160, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 512, "rms_norm_eps": 1e-5}
    if kind == "llama3":
        rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
        cfg, cls = LlamaConfig(**common, rope_parameters=rope, tie_word_embeddings=False), LlamaForCausalLM
    elif kind == "linear":
        rope = {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0}
        cfg, cls = LlamaConfig(**common, rope_parameters=rope, tie_word_embeddings=False), LlamaForCausalLM
    elif kind == "tied":
        cfg = LlamaConfig(**{**common, "num_attention_heads": 6, "num_key_value_heads": 3, "hidden_size": 96},
                          tie_word_embeddings=True)
        cls = LlamaForCausalLM
    elif kind == "mistral":
        cfg, cls = MistralConfig(**common, sliding_window=None, tie_word_embeddings=False), MistralForCausalLM
    elif kind == "qwen2":
        cfg, cls = Qwen2Config(**common, tie_word_embeddings=False), Qwen2ForCausalLM
    else:
        raise ValueError(kind)
    torch.manual_seed(1234)
    model = cls(cfg).eval()
    with torch.no_grad():  # larger-than-init weights so the logits (and any mistake) are not tiny
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            elif name.endswith("bias"):
                p.copy_(0.5 * torch.randn_like(p))
            else:
                p.copy_(torch.randn_like(p) / p.shape[-1] ** 0.5)
    d = tmp_path / kind
    model.half().save_pretrained(d, safe_serialization=True)
    ref = cls.from_pretrained(d, dtype=torch.float32, attn_implementation="eager").eval()
    return d, ref


def _run(model: LlamaModel, prompts: list[list[int]], chunked: bool, page: int = PAGE) -> torch.Tensor:
    """Our logits for every prompt position, [B, T, V]: whole prompt in one forward, or one token per step."""
    b, t = len(prompts), len(prompts[0])
    per_seq = -(-t // page)
    cache = model.make_cache(b * per_seq + 1, page)
    # Interleaved, reversed page ids: sequence i owns pages b*per_seq - i - j*b (never contiguous).
    tables = [[b * per_seq - i - j * b for j in range(per_seq)] for i in range(b)]
    runner = ModelRunner(model, cache, per_seq)
    if chunked:
        return runner.run(prompts, [0] * b, tables, logits="all")
    steps = [runner.run([[p[i]] for p in prompts], [i] * b, tables, logits="all") for i in range(t)]
    return torch.cat(steps, dim=1)


@pytest.mark.parametrize("kind", ["llama3", "linear", "tied", "mistral", "qwen2"])
def test_tiny_parity_with_transformers(tmp_path, kind):
    d, ref = _tiny_dir(tmp_path, kind)
    ours = LlamaModel.from_dir(d, "cpu")
    assert ours.dtype == torch.float32  # CPU computes in fp32
    if kind == "tied":
        assert ours.lm_head is None
    if kind == "qwen2":
        assert ours.layers[0].qkv.bias is not None
    g = torch.Generator().manual_seed(7)
    prompts = torch.randint(0, 300, (2, 21), generator=g)
    with torch.no_grad():
        expected = ref(prompts).logits.float()  # [B, T, V]
    for chunked in (True, False):
        got = _run(ours, prompts.tolist(), chunked)
        assert got.shape == expected.shape and got.dtype == torch.float32
        diff = (got - expected).abs().max().item()
        assert diff < TINY_ATOL, f"{kind} chunked={chunked}: max abs diff {diff:.2e} (logit scale " \
                                 f"{expected.abs().max().item():.2f})"
    # logits="last" is the last row of "all"
    last = _run(ours, prompts.tolist()[:1], chunked=True)[:, -1]
    cache = ours.make_cache(4, PAGE)
    runner = ModelRunner(ours, cache, 4)
    assert torch.allclose(runner.run(prompts.tolist()[:1], [0], [[0, 1, 2]]), last, atol=1e-5, rtol=0)


def test_padded_head_sliced_to_vocab(tmp_path):
    """A head wider than vocab_size (padded quantized heads) never yields logits past vocab_size."""
    d, _ = _tiny_dir(tmp_path, "llama3")
    ours = LlamaModel.from_dir(d, "cpu")
    before = _run(ours, [[1, 2, 3]], chunked=True)
    w = torch.cat([ours.lm_head.weight_t, torch.randn(64, 20) * 100], dim=1)  # 20 bogus padding columns
    ours.lm_head.weight_t, ours.lm_head.out_features = w, w.shape[1]
    after = _run(ours, [[1, 2, 3]], chunked=True)
    assert after.shape[-1] == 300
    assert torch.equal(after, before)


def _transformers_on_dequantized(fp16_dir, exl2_dir, ids: list[int]) -> torch.Tensor:
    """transformers' fp32 logits [1, T, V] for the FP16 model with every linear (and a quantized head)
    replaced by the EXL2 directory's dequantized weights."""
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoModelForCausalLM

    from exl2_backend import ops
    from exl2_backend.format.config import ModelConfig
    from exl2_backend.format.reader import load_weights

    # our writer names shards output*.safetensors (ExLlamaV2's naming), so load the state dict by hand
    hf_cfg = AutoConfig.from_pretrained(fp16_dir)
    hf = AutoModelForCausalLM.from_config(hf_cfg, dtype=torch.float32, attn_implementation="eager").eval()
    state = {k: v.float() for f in sorted(Path(fp16_dir).glob("*.safetensors")) for k, v in load_file(f).items()}
    missing, unexpected = hf.load_state_dict(state, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    if hf_cfg.tie_word_embeddings:
        hf.tie_weights()
    q = load_weights(exl2_dir, ModelConfig.from_dir(exl2_dir))

    def put(mod, qt):
        mod.weight = torch.nn.Parameter(ops.exl2_dequant(qt).float()[:, : qt.out_features].t().contiguous())
        if qt.bias is not None:
            mod.bias = torch.nn.Parameter(qt.bias[: qt.out_features].float())

    with torch.no_grad():
        for lw, layer in zip(q.layers, hf.model.layers):
            for n in ("q_proj", "k_proj", "v_proj", "o_proj"):
                put(getattr(layer.self_attn, n), getattr(lw, n))
            for n in ("gate_proj", "up_proj", "down_proj"):
                put(getattr(layer.mlp, n), getattr(lw, n))
        if q.lm_head is not None:  # a quantized head (also when the FP16 model ties it to the embedding)
            hf.config.tie_word_embeddings = False
            hf.lm_head = torch.nn.Linear(hf.config.hidden_size, q.lm_head.out_features, bias=False)
            put(hf.lm_head, q.lm_head)
        return hf(torch.tensor([ids])).logits.float()


@pytest.mark.parametrize("arch,tied", [("Qwen2ForCausalLM", False), ("LlamaForCausalLM", True)])
def test_tiny_exl2_matches_transformers_on_dequantized(tmp_path, arch, tied):
    """EXL2 linears (all bit widths, act-order perms, Qwen2 biases, a quantized head beside tied embeddings)
    through our model vs transformers on the same dequantized weights: max abs < 1e-4."""
    from tests.helpers.synth import tiny_config_dict, write_tiny_exl2_model, write_tiny_fp16_model

    cfg = tiny_config_dict(arch, tie_word_embeddings=tied)
    fp16_dir = write_tiny_fp16_model(tmp_path / "fp16", cfg, seed=3)
    exl2_dir = write_tiny_exl2_model(tmp_path / "exl2", cfg, seed=3)
    ids = torch.randint(0, 300, (20,), generator=torch.Generator().manual_seed(2)).tolist()
    expected = _transformers_on_dequantized(fp16_dir, exl2_dir, ids)
    ours = LlamaModel.from_dir(exl2_dir, "cpu")
    for chunked in (True, False):
        got = _run(ours, [ids], chunked)
        diff = (got - expected).abs().max().item()
        assert diff < TINY_ATOL, f"chunked={chunked}: max abs diff {diff:.2e}"


# --- the real default model ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def smol(default_fp16_dir):
    from exl2_backend.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(default_fp16_dir)
    ids = tok.encode(PARAGRAPH)
    assert 50 < len(ids) < 200
    return tok, ids


@pytest.fixture(scope="module")
def smol_fp16_logits(default_fp16_dir, smol):
    """Our FP16 model's logits on the paragraph, [1, T, V]."""
    return _run(LlamaModel.from_dir(default_fp16_dir, "cpu"), [smol[1]], chunked=True, page=16)


@pytest.mark.slow
def test_smollm2_fp16_matches_transformers(default_fp16_dir, smol, smol_fp16_logits):
    from transformers import LlamaForCausalLM

    _, ids = smol
    ref = LlamaForCausalLM.from_pretrained(default_fp16_dir, dtype=torch.float32, attn_implementation="eager")
    with torch.no_grad():
        expected = ref(torch.tensor([ids])).logits.float()  # [1, T, V]
    del ref
    got = smol_fp16_logits
    scale = expected.abs().max().item()
    diff = (got - expected).abs().max().item()
    assert diff < 2e-3 * scale, f"max abs diff {diff:.3e} vs logit scale {scale:.1f}"
    assert torch.equal(got.argmax(-1), expected.argmax(-1))


@pytest.mark.slow
def test_smollm2_exl2_logits(default_fp16_dir, default_model_dir, smol, smol_fp16_logits):
    """Our EXL2 forward equals transformers run on the dequantized weights; and the quantized model stays
    close to FP16 (5.0 bpw GPTQ: eval measured top-1 agreement 0.90, KL 0.035)."""
    _, ids = smol
    got = _run(LlamaModel.from_dir(default_model_dir, "cpu"), [ids], chunked=True, page=16)  # [1, T, V]
    ref = smol_fp16_logits

    expected = _transformers_on_dequantized(default_fp16_dir, default_model_dir, ids)
    scale = expected.abs().max().item()
    assert (got - expected).abs().max().item() < 2e-3 * scale

    agree = (got.argmax(-1) == ref.argmax(-1)).float().mean().item()
    in_top5 = (ref[0].topk(5, -1).indices == got[0].argmax(-1)[:, None]).any(-1).float().mean().item()
    lp_ref, lp_got = ref.log_softmax(-1), got.log_softmax(-1)
    kl = (lp_ref.exp() * (lp_ref - lp_got)).sum(-1).mean().item()
    assert agree >= 0.7 and in_top5 >= 0.95 and kl < 0.2, f"top-1 {agree:.3f}, in top-5 {in_top5:.3f}, KL {kl:.3f}"
