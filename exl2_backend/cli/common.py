"""Arguments shared by several subcommands (model location, device, context, multi-GPU, sampling)."""

from __future__ import annotations

import argparse
from pathlib import Path

from exl2_backend.cache.kv_types import CACHE_TYPE_NAMES


def add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("model_dir", nargs="?", default=None,
                   help="EXL2 (or FP16 HF) model directory; default: the embedded SmolLM2-135M-Instruct")
    p.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N")
    p.add_argument("--max-seq-len", type=int, default=None, help="context length to plan the cache for")
    p.add_argument("--cache-type", default="fp16", choices=CACHE_TYPE_NAMES,
                   help="KV cache storage: fp16 (default), fp8, q8, q6 or q4 (quantized pages, more context per GB)")
    add_multi_gpu_args(p)


def add_multi_gpu_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("multi-GPU (one of)")
    g.add_argument("--gpu-split", metavar="GB,GB,...",
                   help="layer split: a budget in GB (1e9 bytes) per device, e.g. 20,23 for cuda:0 and cuda:1")
    g.add_argument("--autosplit", action="store_true",
                   help="layer split over every visible GPU, filled in order (KV cache and scratch reserved)")
    g.add_argument("--tensor-parallel", type=int, default=1, metavar="N",
                   help="tensor parallelism over N GPUs (one process per GPU, NCCL)")


def multi_gpu_settings_from_args(args) -> dict:
    """LoadSettings fields of the multi-GPU flags (only those given); a malformed --gpu-split is a ConfigError."""
    from exl2_backend.errors import ConfigError

    out: dict = {}
    if getattr(args, "gpu_split", None):
        try:
            out["gpu_split"] = [float(x) for x in args.gpu_split.split(",") if x.strip()]
        except ValueError:
            raise ConfigError(f"--gpu-split takes GB per device separated by commas (e.g. 20,23), got "
                              f"{args.gpu_split!r}", field="gpu_split") from None
    if getattr(args, "autosplit", False):
        out["autosplit"] = True
    if (getattr(args, "tensor_parallel", 1) or 1) > 1:
        out["tensor_parallel"] = args.tensor_parallel
    return out


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("sampling")
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--min-p", type=float, default=0.0)
    g.add_argument("--repetition-penalty", type=float, default=1.0)
    g.add_argument("--frequency-penalty", type=float, default=0.0)
    g.add_argument("--presence-penalty", type=float, default=0.0)
    g.add_argument("--seed", type=int, default=None)


def resolve_model_dir(arg: str | None) -> Path:
    """The given directory, or the embedded default model (prepared on first use)."""
    if arg:
        return Path(arg)
    from exl2_backend.default_model import ensure_default_model

    return ensure_default_model()


def sampling_from_args(args):
    from exl2_backend.sampling import SamplingParams

    return SamplingParams(
        temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p,
        repetition_penalty=args.repetition_penalty, frequency_penalty=args.frequency_penalty,
        presence_penalty=args.presence_penalty, seed=args.seed,
    )


def add_prefill_args(p: argparse.ArgumentParser) -> None:
    """Chunked prefill and prefix cache flags (generate, serve)."""
    g = p.add_argument_group("prefill")
    g.add_argument("--max-input-len", type=int, default=None, metavar="N",
                   help="most tokens one forward pass carries across the batch (bounds prefill scratch memory; "
                        "default: the chunk size)")
    g.add_argument("--no-prefix-caching", dest="prefix_caching", action="store_false",
                   help="do not reuse the KV pages of prompt prefixes seen before (prefix caching is on by default)")


def prefill_settings_from_args(args) -> dict:
    """LoadSettings fields of the prefill flags (only those given)."""
    out = {}
    if getattr(args, "max_input_len", None) is not None:
        out["max_input_len"] = args.max_input_len
    if not getattr(args, "prefix_caching", True):
        out["prefix_caching"] = False
    return out


def add_spec_args(p: argparse.ArgumentParser) -> None:
    """Speculative decoding flags (generate, serve, bench)."""
    g = p.add_argument_group("speculative decoding")
    g.add_argument("--draft-model", default=None, metavar="DIR",
                   help="a small EXL2 model with the target's vocabulary that drafts tokens for the target to verify")
    g.add_argument("--num-speculative-tokens", type=int, default=None, metavar="K",
                   help="tokens drafted per step (default 4; the largest k with --adaptive-speculation is 2K)")
    g.add_argument("--ngram", action="store_true",
                   help="draft by prompt lookup (n-gram matches in the prompt and output; no draft model needed)")
    g.add_argument("--adaptive-speculation", action="store_true",
                   help="raise/lower k per sequence from the running acceptance rate")


def spec_settings_from_args(args) -> dict:
    """LoadSettings fields of the speculative decoding flags (only those given)."""
    out = {}
    if getattr(args, "draft_model", None):
        out["draft_model"] = str(resolve_model_dir(args.draft_model))
    if getattr(args, "num_speculative_tokens", None) is not None:
        out["num_speculative_tokens"] = args.num_speculative_tokens
    if getattr(args, "ngram", False):
        out["ngram"] = True
    if getattr(args, "adaptive_speculation", False):
        out["adaptive_speculation"] = True
    return out
