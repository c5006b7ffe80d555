"""A ``kvtier serve`` process for benchmarks, and the threaded load that drives it.

A leaf: ``kvtier bench daemon`` (:mod:`.daemon`), its same-host rows (:mod:`._same_host`)
and the vLLM disaggregated mode (:mod:`.vllm_e2e`) start a daemon and time runs with
these; this module imports none of them.
"""

from __future__ import annotations

import contextlib
import os
import signal
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvtier.bench.redis_procs import free_port

MiB = 1 << 20


def _wait(ready: Callable[[], bool], proc: subprocess.Popen[bytes], what: str, log: Path) -> None:
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with {proc.returncode}: {log.read_text()[-2000:]}")
        try:
            if ready():
                return
        except Exception:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"{what} did not start: {log.read_text()[-2000:]}")


def stop_process(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def start_kvtier(
    tmp: Path,
    capacity: str,
    *,
    io_threads: int = 4,
    max_value_bytes: int = 4 * MiB,
    settings: tuple[str, ...] = (),
) -> tuple[str, subprocess.Popen[bytes]]:
    """A ``kvtier serve`` on a free port, its data under ``tmp``; ``settings`` are more
    ``--set key=value`` pairs."""
    port = free_port()
    log = tmp / f"kvtier-{port}.log"
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVTIER_")}
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "kvtier.cli.main",
                "serve",
                "--port",
                str(port),
                "--set",
                f"service.max_value_bytes={max_value_bytes}",
                "--set",
                f"tiers.0.capacity_bytes={capacity}",
                "--set",
                f"store.io_threads={io_threads}",
                # pin=auto imports torch only to learn there is no CUDA here: slow start.
                "--set",
                "tiers.0.pin=off",
                "--set",
                "log_level=WARNING",
                # Never the user's data directory: a daemon of theirs may hold it.
                "--set",
                f"service.data_dir={tmp / f'data-{port}'}",
                *(arg for kv in settings for arg in ("--set", kv)),
            ],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
        )
    url = f"http://127.0.0.1:{port}"
    import httpx

    _wait(
        lambda: httpx.get(f"{url}/readyz", timeout=1).status_code == 200, proc, "kvtier serve", log
    )
    return url, proc


# -- load generation ---------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Run:
    wall_s: float
    nbytes: int
    latencies_s: list[float]
    # CPU seconds the round cost the server process and this (client) process, all
    # threads: per request, far steadier than wall time on a shared, loaded machine.
    server_cpu_s: float = 0.0
    client_cpu_s: float = 0.0

    @property
    def GBps(self) -> float:
        return self.nbytes / self.wall_s / 1e9


def drive(op: Callable[[int], int], n_ops: int, concurrency: int, pool: ThreadPoolExecutor) -> Run:
    """Run ``op(i)`` for i in range(n_ops) on ``concurrency`` threads; op returns bytes moved."""
    lock = threading.Lock()
    nxt = [0]
    lat: list[list[float]] = [[] for _ in range(concurrency)]
    moved = [0] * concurrency
    span = [(0.0, 0.0)] * concurrency
    start = threading.Barrier(concurrency)

    def worker(w: int) -> None:
        start.wait()
        first = time.perf_counter()
        while True:
            with lock:
                i = nxt[0]
                nxt[0] += 1
            if i >= n_ops:
                break
            t0 = time.perf_counter()
            moved[w] += op(i)
            lat[w].append(time.perf_counter() - t0)
        span[w] = (first, time.perf_counter())

    futs = [pool.submit(worker, w) for w in range(concurrency)]
    for f in futs:
        f.result()
    # Wall time from the first worker's start to the last one's end, as the workers saw
    # it: a clock on this thread would start late when a short run ends before this
    # thread is scheduled again after the barrier (a fast memcpy round did).
    wall = max(e for _, e in span) - min(s for s, _ in span)
    return Run(wall, sum(moved), [x for xs in lat for x in xs])


def cpu_ns(pid: int) -> int:
    """CPU time of every thread of ``pid`` so far (schedstat: run time, ns)."""
    total = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        # A thread that ended between the listing and the read counts no more.
        with contextlib.suppress(FileNotFoundError, ProcessLookupError):
            total += int((task / "schedstat").read_text().split()[0])
    return total


def drive_cpu(
    op: Callable[[int], int], n_ops: int, concurrency: int, pool: ThreadPoolExecutor, pid: int
) -> Run:
    """:func:`drive`, with the CPU time of server ``pid`` and of this process (nanosecond
    clocks: a run of a few requests still measures)."""
    s0, c0 = cpu_ns(pid), time.process_time_ns()
    run = drive(op, n_ops, concurrency, pool)
    s1, c1 = cpu_ns(pid), time.process_time_ns()
    return Run(run.wall_s, run.nbytes, run.latencies_s, (s1 - s0) / 1e9, (c1 - c0) / 1e9)


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


def versus(
    k_runs: list[Run], b_runs: list[Run], base: str, ratio_key: str = "ratio"
) -> dict[str, Any]:
    """kvtier's runs of one point against a baseline's: median GB/s of each, their ratio,
    and the latency percentiles over every operation of every run."""
    k_gbps = statistics.median(r.GBps for r in k_runs)
    b_gbps = statistics.median(r.GBps for r in b_runs)
    k_lat = [x for r in k_runs for x in r.latencies_s]
    b_lat = [x for r in b_runs for x in r.latencies_s]
    return {
        "kvtier_GBps": round(k_gbps, 4),
        f"{base}_GBps": round(b_gbps, 4),
        ratio_key: round(k_gbps / b_gbps, 3),
        "p50_ms": round(_pct(k_lat, 0.5) * 1e3, 3),
        "p99_ms": round(_pct(k_lat, 0.99) * 1e3, 3),
        f"{base}_p50_ms": round(_pct(b_lat, 0.5) * 1e3, 3),
        f"{base}_p99_ms": round(_pct(b_lat, 0.99) * 1e3, 3),
    }
