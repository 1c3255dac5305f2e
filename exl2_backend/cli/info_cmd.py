"""`exl2-backend info`: architecture, bits per weight per layer, sizes, and the memory plan of a load (per device,
with --gpu-split / --autosplit / --tensor-parallel); exits 1 when that plan does not fit or the directory lacks
tensors a load needs."""

from __future__ import annotations

import json

from exl2_backend.cli.common import resolve_model_dir


def add_parser(sub):
    p = sub.add_parser("info", help="describe a model directory")
    p.add_argument("model_dir", nargs="?", default=None, help="default: the embedded model")
    p.add_argument("--json", action="store_true", help="print machine-readable JSON")
    p.add_argument("--max-seq-len", type=int, default=None,
                   help="context length for the memory estimate (default: 4096, or the model's "
                        "max_position_embeddings where smaller)")
    p.add_argument("--vram-gb", type=float, default=24.0,
                   help="GPU memory budget (GiB) for the max-context column of the KV cache table (default 24)")
    p.add_argument("--reserve-gb", type=float, default=1.0,
                   help="part of --vram-gb kept for activations, scratch and the CUDA context (default 1)")
    g = p.add_argument_group("memory plan (what a load with these settings would put on each device)")
    g.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N (cuda works without a GPU: "
                   "sizes are shown, budgets only checked against --gpu-split)")
    g.add_argument("--cache-tokens", type=int, default=None, help="KV cache size in tokens (default: as the engine)")
    g.add_argument("--cache-type", default="fp16", help="KV cache type of the plan (fp16, fp8, q8, q6, q4)")
    g.add_argument("--max-batch-size", type=int, default=1, help="decode batch the scratch is planned for")
    g.add_argument("--draft-model", default=None, help="a draft model directory planned beside the model")
    from exl2_backend.cli.common import add_multi_gpu_args

    add_multi_gpu_args(p)
    p.set_defaults(func=run)
    return p


def _memory_plan(args, model_dir):
    """-> (VramPlan, VramPlanError | None) for the plan flags."""
    from exl2_backend.cli.common import multi_gpu_settings_from_args
    from exl2_backend.errors import VramPlanError
    from exl2_backend.plan import plan_load
    from exl2_backend.runtime import LoadSettings

    settings = LoadSettings(model_dir=str(model_dir), device=args.device, max_seq_len=args.max_seq_len,
                            cache_tokens=args.cache_tokens, cache_type=args.cache_type,
                            max_batch_size=args.max_batch_size, draft_model=args.draft_model,
                            **multi_gpu_settings_from_args(args))
    plan = plan_load(settings)
    try:
        plan.check()
    except VramPlanError as exc:
        return plan, exc
    return plan, None


def _prompting(model_dir) -> dict:
    """How requests reach this model: whether it has a chat template, whether that template renders tools itself
    (else tools go in the Hermes form), the convention its tool calls are read in, whether it thinks in <think>
    tags (returned apart as reasoning_content), and its fill-in-the-middle markers (the completions API's suffix)."""
    from exl2_backend.errors import Exl2Error
    from exl2_backend.tokenizer import Tokenizer
    from exl2_backend.tokenizer.fim import fim_marker_ids
    from exl2_backend.tokenizer.tool_formats import template_takes_tools

    try:
        tok = Tokenizer.from_dir(model_dir)
    except Exl2Error as exc:
        return {"error": str(exc)}
    source = tok.chat_template_source if isinstance(tok.chat_template_source, str) else None
    markers = fim_marker_ids(tok)
    return {"chat_template": tok.has_chat_template,
            "tools": "template" if source and template_takes_tools(source) else "hermes",
            "tool_call_format": tok.tool_call_format().name,
            "reasoning": tok.reasoning_tags() is not None,
            "fill_in_the_middle": None if markers is None else [tok.id_to_token(i) for i in markers]}


def run(args) -> int:
    from exl2_backend.cache.budget import GIB, cache_type_table
    from exl2_backend.format.inspect import describe_model

    model_dir = resolve_model_dir(args.model_dir)
    info = describe_model(model_dir)
    if args.max_seq_len is None:
        args.max_seq_len = min(4096, info["max_position_embeddings"])
    plan, plan_error = _memory_plan(args, model_dir)
    info["memory_plan"] = {**plan.to_dict(), "fits": plan_error is None,
                           "error": None if plan_error is None else str(plan_error)}
    info["kv_cache_types"] = cache_type_table(
        info["num_layers"], info["num_key_value_heads"], info["head_dim"],
        weights_bytes=info["memory"]["weights_bytes"], vram_bytes=int(args.vram_gb * GIB),
        reserve_bytes=int(args.reserve_gb * GIB), context=args.max_seq_len)
    info["kv_cache_budget"] = {"vram_gb": args.vram_gb, "reserve_gb": args.reserve_gb, "context": args.max_seq_len}
    info["prompting"] = _prompting(model_dir)
    ok = plan_error is None and not info["missing_tensors"]
    if args.json:
        print(json.dumps(info, indent=2, default=str))
        return 0 if ok else 1
    from exl2_backend.cli.info_render import render, render_missing, render_plan

    render(info, max_seq_len=args.max_seq_len)
    render_plan(plan, plan_error)
    render_missing(info["missing_tensors"])
    return 0 if ok else 1
