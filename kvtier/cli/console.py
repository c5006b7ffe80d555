"""Consoles of the CLI: tables on stdout that keep their columns when piped, errors on
stderr as one unwrapped line."""

from __future__ import annotations

import sys

from rich.console import Console
from rich.markup import escape

# Wide enough for any table kvtier prints; only used when stdout is not a terminal.
_PIPE_WIDTH = 1000


def stdout_console() -> Console:
    """Console for reports on stdout.

    On a terminal, rich fits tables to its width. Piped (``| less``, ``> out.txt``), rich
    would assume 80 columns and cut cells ("capaci…"); there the console is as wide as the
    widest table, so every column keeps its full text. ``COLUMNS`` still wins when set.
    """
    import os

    if sys.stdout.isatty() or os.environ.get("COLUMNS"):
        return Console()
    return Console(width=_PIPE_WIDTH)


def print_error(console: Console, message: str) -> None:
    """``error: MESSAGE`` as one line: never wrapped, never read as rich markup."""
    console.print(f"[red]error:[/red] {escape(message)}", soft_wrap=True, highlight=False)
