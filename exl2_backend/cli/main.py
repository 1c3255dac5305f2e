"""Entry point of the `exl2-backend` console script: builds the argument parser and dispatches."""

from __future__ import annotations

import argparse
import logging
import os
import sys

from exl2_backend._version import __version__
from exl2_backend.errors import Exl2Error


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="exl2-backend", description="Run EXL2-quantized LLMs.")
    parser.add_argument("--version", action="version", version=f"exl2-backend {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    sub = parser.add_subparsers(dest="command", required=True)

    from exl2_backend.cli import generate_cmd, info_cmd

    generate_cmd.add_parser(sub)
    info_cmd.add_parser(sub)
    _add_optional(sub, "exl2_backend.cli.bench_cmd")
    _add_optional(sub, "exl2_backend.cli.serve_cmd", adder="add_serve_parser", runner="run_serve")
    _add_optional(sub, "exl2_backend.cli.convert_cmd")
    _add_optional(sub, "exl2_backend.cli.eval_cmd")
    return parser


def _add_optional(sub, module: str, adder: str = "add_parser", runner: str = "run") -> None:
    """Register a subcommand whose module may need optional extras (litserve, matplotlib)."""
    import importlib

    try:
        mod = importlib.import_module(module)
    except ImportError as exc:
        if exc.name and module.endswith(exc.name.rsplit(".", 1)[-1]):
            return  # subcommand not shipped in this build
        raise
    p = getattr(mod, adder)(sub)
    if p is not None and getattr(p, "_defaults", {}).get("func") is None:
        p.set_defaults(func=getattr(mod, runner))


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    level = logging.INFO if args.verbose else getattr(logging, os.environ.get("EXL2_BACKEND_LOG_LEVEL", "WARNING"))
    logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s")
    try:
        return int(args.func(args) or 0)
    except Exl2Error as exc:
        print(f"error: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
