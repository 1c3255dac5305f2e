"""Quality of a quantized model against its FP16 reference on held-out text.

The text (default: `calibration.load_eval_text()`, disjoint from the calibration set) is tokenized once with
the model's tokenizer and cut into consecutive, non-overlapping windows of `window` tokens (a BOS token
starts each window when the tokenizer adds one). Each window is run from position 0 through
`LlamaModel.forward(..., logits="all")` over a paged KV cache, once by the model and once by the reference.
Within a window, position i predicts token i+1; the first token of a window is context only. Over all
scored positions t (N of them), with p = the model's and q = the reference's next-token distribution:

- perplexity (PPL) = exp(-(1/N) * sum_t log p_t(x_{t+1})), the same for the reference with q;
- KL = (1/N) * sum_t KL(q_t || p_t) = (1/N) * sum_t sum_v q_t(v) * (log q_t(v) - log p_t(v)), in nats:
  how much of the reference's distribution the model loses, 0 only for identical distributions;
- top-1 agreement = fraction of positions where argmax p_t == argmax q_t;
- top-1 accuracy (of each) = fraction of positions where the argmax is the actual next token.

All sums are in float64 over float32 log-softmaxes of the float32 logits.
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from exl2_backend.errors import ConfigError, InvalidRequestError

DEFAULT_WINDOW = 512
PAGE_SIZE = 64


@dataclass
class EvalResult:
    """Figures of one evaluation; `to_dict()` is the JSON the CLI prints."""

    tokens: int  # scored positions N
    windows: int
    window: int
    perplexity: float
    reference_perplexity: float
    kl_mean: float  # nats per token, KL(reference || model)
    kl_max: float  # largest per-position KL
    top1_agreement: float
    top1_accuracy: float  # model's argmax == next token
    reference_top1_accuracy: float
    seconds: float = 0.0
    meta: dict = field(default_factory=dict)  # model/reference dirs, device, text source, ...

    def to_dict(self) -> dict:
        return asdict(self)


def _windows(ids: list[int], window: int, bos: int | None) -> list[list[int]]:
    """Consecutive windows of `window` tokens (BOS + window-1 text tokens when `bos` is given); a last window
    shorter than 2 tokens is dropped (nothing to score)."""
    if window < 2:
        raise ValueError("window must be at least 2 tokens")
    step = window - 1 if bos is not None else window
    out = []
    for s in range(0, len(ids), step):
        w = ([bos] if bos is not None else []) + ids[s : s + step]
        if len(w) >= 2:
            out.append(w)
    return out


class _Runner:
    """One model with a cache (of `cache_type`) sized for one window; runs a window from position 0."""

    def __init__(self, model, window: int, cache_type: str = "fp16"):
        from exl2_backend.runtime.model_runner import ModelRunner

        pages = -(-window // PAGE_SIZE)
        self.table = list(range(pages))
        self.runner = ModelRunner(model, model.make_cache(pages, PAGE_SIZE, cache_type=cache_type), pages)

    def logits(self, ids: list[int]) -> torch.Tensor:
        """f32 logits [T, V] for every position of `ids`."""
        table = self.table[: -(-len(ids) // PAGE_SIZE)]
        return self.runner.run([ids], [0], [table], logits="all")[0]


def evaluate_models(model, reference, ids: list[int], window: int = DEFAULT_WINDOW, bos: int | None = None,
                    progress: bool = False, cache_type: str = "fp16",
                    reference_cache_type: str = "fp16") -> EvalResult:
    """Compare loaded `model` and `reference` (`LlamaModel`s, same vocabulary) on token ids `ids`. The model runs
    over a KV cache of `cache_type`, the reference over one of `reference_cache_type` (with reference = model and
    cache_type q4, KL measures what the quantized cache alone costs)."""
    if model.vocab_size != reference.vocab_size:
        raise ConfigError(f"vocabulary sizes differ: model {model.vocab_size}, reference {reference.vocab_size}")
    wins = _windows(ids, window, bos)
    if not wins:
        raise InvalidRequestError("the evaluation text needs at least 2 tokens", field="text")
    t0 = time.perf_counter()
    run_m = _Runner(model, window, cache_type)
    # its own cache even when `reference is model` (then KL ~ 0 checks the path)
    run_r = _Runner(reference, window, reference_cache_type)
    nll_m = nll_r = kl_sum = 0.0
    kl_max = 0.0
    agree = hit_m = hit_r = n = 0
    it = wins
    if progress:
        from tqdm import tqdm

        it = tqdm(wins, desc="eval", unit="window", leave=False)
    for w in it:
        target = torch.tensor(w[1:], dtype=torch.int64, device=model.device)  # [T-1]
        lm = torch.log_softmax(run_m.logits(w)[:-1].float(), dim=-1)  # [T-1, V]
        lr = torch.log_softmax(run_r.logits(w)[:-1].float().to(lm.device), dim=-1)
        kl = (lr.exp() * (lr - lm)).sum(-1).clamp_min(0.0)  # [T-1]
        nll_m -= lm.gather(1, target[:, None]).double().sum().item()
        nll_r -= lr.gather(1, target[:, None]).double().sum().item()
        kl_sum += kl.double().sum().item()
        kl_max = max(kl_max, kl.max().item())
        am, ar = lm.argmax(-1), lr.argmax(-1)
        agree += (am == ar).sum().item()
        hit_m += (am == target).sum().item()
        hit_r += (ar == target).sum().item()
        n += target.numel()
        del lm, lr, kl
    return EvalResult(
        tokens=n, windows=len(wins), window=window,
        perplexity=math.exp(nll_m / n), reference_perplexity=math.exp(nll_r / n),
        kl_mean=kl_sum / n, kl_max=kl_max, top1_agreement=agree / n,
        top1_accuracy=hit_m / n, reference_top1_accuracy=hit_r / n,
        seconds=time.perf_counter() - t0,
    )


def tokenize_eval_text(model_dir: str | Path, text: str | None = None, max_tokens: int | None = None,
                       reference_dir: str | Path | None = None) -> tuple[list[int], int | None]:
    """(text token ids without special tokens, at most `max_tokens`; the BOS id to start windows with or None).

    `text` defaults to the held-out `load_eval_text()`. With `reference_dir` the reference's tokenizer must
    encode the text identically (KL and agreement compare position by position)."""
    from exl2_backend.quant.calibration import load_eval_text
    from exl2_backend.tokenizer import Tokenizer

    if text is None:
        text = load_eval_text()
    tok = Tokenizer.from_dir(model_dir)
    ids = tok.encode(text, add_special_tokens=False)
    if max_tokens is not None:
        ids = ids[:max_tokens]
    if reference_dir is not None and Path(reference_dir).resolve() != Path(model_dir).resolve():
        ref_tok = Tokenizer.from_dir(reference_dir)
        probe = text[:4000]
        if ref_tok.encode(probe, add_special_tokens=False) != tok.encode(probe, add_special_tokens=False):
            raise ConfigError(f"{model_dir} and {reference_dir} tokenize text differently; "
                              "the reference must be the model's unquantized source")
    bos = tok.bos_token_id if tok.add_bos_token and tok.bos_token_id is not None else None
    return ids, bos


_SHAPE_FIELDS = ("architecture", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                 "num_attention_heads", "num_key_value_heads")


def _same_shape(config, reference, reference_dir: str) -> None:
    """ConfigError naming the first field where the reference's shape differs from the model's: KL against
    another model's distribution measures nothing about this one's quantization (a wrong --reference directory
    would otherwise give a plausible-looking table)."""
    for name in _SHAPE_FIELDS:
        mine, theirs = getattr(config, name), getattr(reference, name)
        if mine != theirs:
            raise ConfigError(f"the reference is another model: {name} {theirs} where the evaluated model has "
                              f"{mine}", field=name, path=reference_dir)


def evaluate(model_dir: str | Path, reference_dir: str | Path, text: str | None = None,
             max_tokens: int | None = None, window: int = DEFAULT_WINDOW, device: str = "auto",
             progress: bool = False, cache_type: str = "fp16") -> EvalResult:
    """Load `model_dir` (EXL2 or FP16) and `reference_dir` (FP16) and compare them on `text` (default: the
    held-out evaluation text), at most `max_tokens` tokens of it, in windows of `window` tokens. The model runs
    over a KV cache of `cache_type`, the reference over an fp16 one."""
    from exl2_backend.format.config import ModelConfig
    from exl2_backend.model import LlamaModel
    from exl2_backend.runtime.settings import require_device

    dev = require_device(device)
    config = ModelConfig.from_dir(model_dir)
    if Path(reference_dir).resolve() != Path(model_dir).resolve():
        _same_shape(config, ModelConfig.from_dir(reference_dir), str(reference_dir))
    limit = config.max_position_embeddings
    if window > limit:  # past the trained positions; its KV cache is sized by the window (1e8: 25 GB)
        raise ConfigError(f"window {window} exceeds the model's max_position_embeddings ({limit})", field="window")
    ids, bos = tokenize_eval_text(model_dir, text, max_tokens, reference_dir)
    t0 = time.perf_counter()
    model = LlamaModel.from_dir(model_dir, dev)
    same = Path(reference_dir).resolve() == Path(model_dir).resolve()
    reference = model if same else LlamaModel.from_dir(reference_dir, dev)
    load_s = time.perf_counter() - t0
    result = evaluate_models(model, reference, ids, window=window, bos=bos, progress=progress, cache_type=cache_type)
    result.meta = {"model_dir": str(model_dir), "reference_dir": str(reference_dir), "device": str(dev),
                   "text": "held-out default (load_eval_text)" if text is None else "user text",
                   "text_tokens": len(ids), "load_seconds": round(load_s, 2), "cache_type": cache_type}
    return result
