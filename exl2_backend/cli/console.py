"""The rich Console the CLI prints its tables with."""

from __future__ import annotations

import os

from rich.console import Console

# Columns off a terminal. rich takes 80 there (a pipe, a log file, a device call's captured output), which cut the
# memory plan's ten columns to "devi…" / "weig…"; a wide line in a log is better than a lost figure.
PIPE_WIDTH = 200


def cli_console() -> Console:
    """A Console for stdout: the terminal's width on a terminal; PIPE_WIDTH columns elsewhere unless COLUMNS is set."""
    console = Console()
    if not console.is_terminal and "COLUMNS" not in os.environ:
        console.width = PIPE_WIDTH
    return console
