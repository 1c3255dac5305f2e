"""Entry point of the `exl2-backend` console script: builds the argument parser and dispatches."""

from __future__ import annotations

import argparse
import logging
import os
import sys

from pydantic import ValidationError

from exl2_backend._version import __version__
from exl2_backend.errors import ConfigError, Exl2Error, error_line


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="exl2-backend", description="Run EXL2-quantized LLMs.")
    parser.add_argument("--version", action="version", version=f"exl2-backend {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    sub = parser.add_subparsers(dest="command", required=True)

    from exl2_backend.cli import bench_cmd, convert_cmd, eval_cmd, generate_cmd, info_cmd, serve_cmd

    # Each subcommand module imports its heavy dependencies (litserve, matplotlib) only when it runs.
    for add in (generate_cmd.add_parser, info_cmd.add_parser, bench_cmd.add_parser, serve_cmd.add_serve_parser,
                convert_cmd.add_parser, eval_cmd.add_parser):
        add(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    level = logging.INFO if args.verbose else getattr(logging, os.environ.get("EXL2_BACKEND_LOG_LEVEL", "WARNING"))
    logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s")
    try:
        return int(args.func(args) or 0)
    except Exl2Error as exc:
        print(error_line(exc), file=sys.stderr)
        return 2
    except ValidationError as exc:  # settings built from the arguments (LoadSettings, ...): name the field
        print(error_line(ConfigError.from_validation(exc)), file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
