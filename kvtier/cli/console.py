"""Consoles of the CLI: tables on stdout that keep their columns when piped, errors on
stderr as one unwrapped line, and log records one per line wherever they are collected."""

from __future__ import annotations

import json
import logging
import sys
import time
from typing import TextIO

from rich.console import Console
from rich.markup import escape
from typing_extensions import override

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


# -- logs -----------------------------------------------------------------------------------

LOG_FORMATS = ("text", "json")


class _LineFormatter(logging.Formatter):
    """``TIME LEVEL LOGGER: MESSAGE`` on one line, time in UTC (ISO 8601).

    A line collector (journald, a file tailer, ``grep``) reads one record per line, so a
    message's own newlines and an exception's traceback are written as ``\\n`` escapes
    instead of breaking the record apart.
    """

    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)s %(name)s: %(message)s")

    @override
    def formatTime(self, record: logging.LogRecord, datefmt: str | None = None) -> str:
        return _utc(record)

    @override
    def format(self, record: logging.LogRecord) -> str:
        return super().format(record).replace("\r", "\\r").replace("\n", "\\n")


class _JsonFormatter(logging.Formatter):
    """One JSON object per line: ``time``, ``level``, ``logger``, ``message``, and
    ``exception`` (the formatted traceback) when the record carries one."""

    @override
    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, str] = {
            "time": _utc(record),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        if record.exc_info:
            out["exception"] = self.formatException(record.exc_info)
        elif record.exc_text:
            out["exception"] = record.exc_text
        if record.stack_info:
            out["stack"] = self.formatStack(record.stack_info)
        return json.dumps(out)


def _utc(record: logging.LogRecord) -> str:
    t = time.gmtime(record.created)
    return time.strftime("%Y-%m-%dT%H:%M:%S", t) + f".{int(record.msecs):03d}Z"


def log_handler(fmt: str = "text", stream: TextIO | None = None) -> logging.Handler:
    """The handler every record goes through (kvtier's, uvicorn's, the libraries').

    Args:
        fmt: ``"text"``: rich's columns on a terminal, one plain line per record
            otherwise (a file, a pipe, a collector: rich would wrap at 80 columns).
            ``"json"``: one JSON object per line, terminal or not.
        stream: where records go; stderr when None.
    """
    if fmt not in LOG_FORMATS:
        raise ValueError(f"log format {fmt!r}: expected one of {LOG_FORMATS}")
    out = sys.stderr if stream is None else stream
    if fmt == "text" and out.isatty():
        from rich.logging import RichHandler

        return RichHandler(console=Console(file=out), show_path=False)
    handler = logging.StreamHandler(out)
    handler.setFormatter(_JsonFormatter() if fmt == "json" else _LineFormatter())
    return handler


def setup_logging(level: str = "INFO", fmt: str = "text") -> None:
    """Send every logger's records to stderr through one handler, at ``level``.

    Replaces the root logger's handlers; a server that configures its own loggers
    (uvicorn) must be told not to (``log_config=None``) so its records propagate here.
    """
    logging.basicConfig(level=level.upper(), handlers=[log_handler(fmt)], force=True)
