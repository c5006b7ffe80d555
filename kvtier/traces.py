"""The request traces shipped with kvtier, and how to open a trace file.

Two public Mooncake (FAST'25, Apache-2.0) traces live in ``kvtier/data/mooncake/``,
gzip-compressed, with their attribution (``README.md`` there). They are package data, so
a clone and an installed kvtier both find them; nothing reads a folder beside the
repository (a user's clone has none; ``tests/unit/test_standalone.py`` guards it).

Wherever a trace is asked for, a shipped name (``mooncake-conversation``,
``mooncake-synthetic``) or a path to a ``.jsonl`` or ``.jsonl.gz`` file is accepted.
"""

from __future__ import annotations

import gzip
from pathlib import Path
from typing import IO

from kvtier.errors import InputError

TRACE_DIR = Path(__file__).resolve().parent / "data" / "mooncake"

# Shipped name -> file in TRACE_DIR.
SHIPPED: dict[str, str] = {
    "mooncake-conversation": "conversation_trace.jsonl.gz",
    "mooncake-synthetic": "synthetic_trace.jsonl.gz",
}


def shipped_trace(name: str) -> Path:
    """The path of a shipped trace.

    Raises:
        InputError: ``name`` is not one of :data:`SHIPPED` (the message lists them).
    """
    try:
        return TRACE_DIR / SHIPPED[name]
    except KeyError:
        raise InputError(
            f"no shipped trace {name!r}; shipped: {', '.join(SHIPPED)} (or give a file path)"
        ) from None


def resolve_trace(spec: str | Path) -> Path:
    """A shipped trace's path for its name, else ``spec`` as a path (not checked here)."""
    s = str(spec)
    return shipped_trace(s) if s in SHIPPED else Path(spec)


def trace_name(path: Path) -> str:
    """A short name for reports: the file name without ``.jsonl``/``.gz``."""
    name = path.name
    for suffix in (".gz", ".jsonl", ".json"):
        name = name.removesuffix(suffix)
    return name


def open_trace(spec: str | Path) -> IO[str]:
    """Open a trace (shipped name or path; ``.gz`` is decompressed) as text.

    Raises:
        InputError: the file cannot be opened; the message names it and the shipped names.
    """
    p = resolve_trace(spec)
    try:
        if p.suffix == ".gz":
            return gzip.open(p, "rt", encoding="utf-8")
        return p.open(encoding="utf-8")
    except OSError as exc:
        raise InputError(
            f"cannot read trace {p}: {exc.strerror or exc}; give a JSONL file or a shipped "
            f"trace: {', '.join(SHIPPED)}"
        ) from exc
