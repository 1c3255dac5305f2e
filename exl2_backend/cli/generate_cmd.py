"""`exl2-backend generate`: stream a completion (or a chat answer) to the terminal, then report tokens/s."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from exl2_backend.cli.common import (
    add_model_args,
    add_prefill_args,
    add_sampling_args,
    add_spec_args,
    multi_gpu_settings_from_args,
    prefill_settings_from_args,
    resolve_model_dir,
    sampling_from_args,
    spec_settings_from_args,
)
from exl2_backend.errors import InvalidRequestError


def add_parser(sub):
    p = sub.add_parser("generate", help="generate text from a prompt or chat messages")
    add_model_args(p)
    src = p.add_mutually_exclusive_group()
    src.add_argument("--prompt", help="raw prompt, completed as-is (no chat template)")
    src.add_argument("--chat", help="one user message, wrapped in the model's chat template")
    src.add_argument("--messages", help="JSON file (or '-') with a list of {role, content} chat messages")
    p.add_argument("--system", help="system message for --chat")
    p.add_argument("--max-new-tokens", "--max-tokens", dest="max_new_tokens", type=int, default=128,
                   help="tokens to generate at most (--max-tokens: the OpenAI API's name for it)")
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--ignore-eos", action="store_true")
    form = p.add_mutually_exclusive_group()  # constrained output (exl2_backend/grammar/)
    form.add_argument("--json", action="store_true", help="the output is one JSON object")
    form.add_argument("--json-schema", metavar="FILE", help="the output is JSON following the schema in FILE")
    form.add_argument("--regex", help="the output matches this regular expression")
    form.add_argument("--choice", action="append", help="the output is one of these strings (repeatable)")
    form.add_argument("--lark", metavar="FILE", help="the output follows the Lark grammar in FILE")
    add_sampling_args(p)
    add_prefill_args(p)
    add_spec_args(p)
    p.set_defaults(func=run)
    return p


def _messages(args) -> list[dict] | None:
    if args.messages:
        try:
            text = sys.stdin.read() if args.messages == "-" else Path(args.messages).read_text(encoding="utf-8")
            msgs = json.loads(text)
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise InvalidRequestError(f"--messages {args.messages}: {exc}", field="messages") from None
        if not isinstance(msgs, list) or not all(isinstance(m, dict) and "role" in m and "content" in m for m in msgs):
            raise InvalidRequestError("--messages must hold a JSON list of {role, content} objects", field="messages")
        return msgs
    if args.chat is not None:
        msgs = [{"role": "system", "content": args.system}] if args.system else []
        return msgs + [{"role": "user", "content": args.chat}]
    return None


def _grammar(args) -> dict | None:
    """The --json / --json-schema / --regex / --choice / --lark constraint as GenerationParams.grammar."""
    if args.json:
        return {"type": "json_object"}
    if args.regex is not None:
        return {"type": "regex", "value": args.regex}
    if args.choice:
        return {"type": "choice", "value": args.choice}
    for kind, path in (("json_schema", args.json_schema), ("lark", args.lark)):
        if path is not None:
            try:
                return {"type": kind, "value": Path(path).read_text(encoding="utf-8")}
            except (OSError, UnicodeDecodeError) as exc:
                raise InvalidRequestError(f"--{kind.replace('_', '-')} {path}: {exc}", field="grammar") from None
    return None


def run(args) -> int:
    from exl2_backend.runtime import Engine, GenerationParams, LoadSettings
    from exl2_backend.runtime.generate import generate_stream

    # the request's values are checked before the model loads (and before the prompt is echoed)
    params = GenerationParams(sampling=sampling_from_args(args), max_new_tokens=args.max_new_tokens,
                              stop=args.stop, ignore_eos=args.ignore_eos, grammar=_grammar(args))
    model_dir = resolve_model_dir(args.model_dir)
    settings = LoadSettings(model_dir=str(model_dir), device=args.device, max_seq_len=args.max_seq_len,
                            cache_type=args.cache_type, max_batch_size=1,
                            **prefill_settings_from_args(args), **spec_settings_from_args(args),
                            **multi_gpu_settings_from_args(args))
    t_load = time.perf_counter()
    engine = Engine.load(settings)
    t_load = time.perf_counter() - t_load
    tok = engine.tokenizer
    messages = _messages(args)
    if messages is not None:
        prompt_ids = tok.encode_chat(messages)
    else:
        prompt_ids = tok.encode(args.prompt if args.prompt is not None else "The capital of France is")
        if args.prompt is None:
            print("(no --prompt given; using 'The capital of France is')", file=sys.stderr)
        print(tok.decode(prompt_ids), end="", flush=True)
    t0 = time.perf_counter()
    t_first = None
    n = 0
    finish = None
    for ev in generate_stream(engine, prompt_ids, params):
        if ev.token_ids and t_first is None:
            t_first = time.perf_counter()
        n += len(ev.token_ids)
        print(ev.text, end="", flush=True)
        if ev.finish_reason:
            finish = ev.finish_reason
            if ev.error:
                print(f"\nerror: {ev.error}", file=sys.stderr)
    t1 = time.perf_counter()
    print()
    decode_s = t1 - (t_first or t0)
    rate = (n - 1) / decode_s if n > 1 and decode_s > 0 else float("nan")
    print(
        f"[{n} tokens, finish={finish}, prompt {len(prompt_ids)} tokens, load {t_load:.2f} s, "
        f"first token {((t_first or t1) - t0) * 1000:.0f} ms, decode {rate:.1f} tokens/s, device {engine.device}]",
        file=sys.stderr,
    )
    if engine.spec is not None:
        st = engine.spec.stats()
        print(f"[speculation {st['spec_mode']}: acceptance {st['spec_acceptance_rate']:.1%}, mean accepted length "
              f"{st['spec_mean_accepted_length']:.2f}, {st['spec_tokens_per_step']:.2f} tokens per step]",
              file=sys.stderr)
    engine.close()  # tensor-parallel ranks
    return 2 if finish == "error" else 0  # a failed generation is a failed command
