"""Benchmarks: each module compares kvtier against a baseline measured in the same run.

Run one with ``kvtier bench NAME [--json FILE]`` or ``python -m kvtier.bench.NAME``.
Every module exposes ``main(argv) -> int``, prints a short table and writes JSON with
the command, the machine, the versions, the ratios and the raw figures. Rows that need
an optional package (torch, redis, vLLM, LMCache, aiofiles, lz4) are skipped with a
printed reason where it is missing (:func:`kvtier.bench.common.optional` and
:func:`~kvtier.bench.common.missing`), and the program exits 0.

``python -m kvtier.bench.NAME`` runs without kvtier's CLI: importing the package composes
``kvtier.policies`` in, so the stores a benchmark builds are the ones users run.
"""

from __future__ import annotations

import pkgutil
from pathlib import Path

from kvtier.policies import compose

compose()

# Modules that serve the benchmarks and are not benchmarks themselves.
HELPERS = frozenset({"common", "redis_procs", "tiny_llama"})


def available() -> list[str]:
    """Names of the benchmark modules in this package."""
    here = Path(__file__).parent
    names = (m.name for m in pkgutil.iter_modules([str(here)]))
    return sorted(n for n in names if not n.startswith("_") and n not in HELPERS)
