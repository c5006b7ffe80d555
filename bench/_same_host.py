"""The same-host rows of ``kvtier bench daemon``: values through shared memory vs memcpy.

A client on the daemon's host moves values through the daemon's same-host channel
(:mod:`kvtier.service.shm`): its values lie in shared memory it created
(``Client.shared_buffer``), the request carries only keys and offsets, and the daemon
copies each value once, between that memory and its host tier. The baseline is what
that one copy costs without a daemon: ``numpy.copyto`` of the same values between two
buffers of this process, on as many threads, in the same run, rounds interleaved.

Rows: ``{op: same_host_get | same_host_put, value_bytes, batch, concurrency, kvtier_GBps,
memcpy_GBps, ratio_memcpy, p50_ms, p99_ms, memcpy_p50_ms, memcpy_p99_ms,
daemon_cpu_us_per_op, client_cpu_us_per_op, memcpy_cpu_us_per_op}`` (medians over repeats;
the CPU columns, all threads of the daemon and of this process per request, say where a
request's time goes beyond its copy),
plus the size's ``first_get_new_buffer_ms`` / ``next_get_same_buffer_ms``: a get into a
shared buffer just made, against the next get into it.
"""

from __future__ import annotations

import os
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

from kvtier.bench._daemon_load import Run, drive_cpu, start_kvtier, stop_process, versus

MiB = 1 << 20
SIZES = (1 * MiB, 4 * MiB, 16 * MiB)
CONCURRENCY = (1, 4)
POOL_VALUES = 4
TARGET_RATIO = 0.8


def rows_for_size(
    tmp: Path,
    size: int,
    concs: list[int],
    *,
    target_bytes: int,
    repeats: int,
    pool: ThreadPoolExecutor,
    batch: int = 1,
) -> list[dict[str, Any]]:
    """Start a daemon whose slot is ``size``, then time get and put at each concurrency.

    ``batch`` values per request (``get_into``/``put_many`` of consecutive keys, as the
    vLLM connector asks for a sequence's chunks); the baseline copies the same bytes
    in one ``numpy.copyto``.
    """
    from kvtier.service.client import Client

    pool_values = max(POOL_VALUES, batch)
    n_keys = max(pool_values, min(64, 256 * MiB // size))
    n_keys -= n_keys % batch  # whole groups of ``batch`` keys
    groups = n_keys // batch
    step = batch * size
    # The host tier holds the get working set plus one round of fresh puts (deleted
    # after the round): a smaller tier demotes the working set to the daemon's nvme
    # tier, and the get rows then time nvme reads, not the same-host channel.
    most_ops = max(max(4 * conc, target_bytes // step) for conc in concs)
    need = (n_keys + most_ops * batch) * size
    capacity = max(1 << 30, need + need // 8)
    # The arena prefaulted, as the baseline's ring is: otherwise the first timed puts into
    # never-touched pages pay the kernel's page faults (a p99 of seconds for the largest
    # rows), a cost of a daemon's first minutes (``prefault = false``, the default), not
    # of the channel.
    url, proc = start_kvtier(
        tmp,
        f"{-(-capacity // MiB)}MiB",
        max_value_bytes=size,
        settings=("tiers.0.prefault=true",),
    )
    resident = _resident_shared_bytes(proc.pid)
    rows: list[dict[str, Any]] = []
    c = Client(url, pool=max(concs) + 1, timeout_s=120)
    try:
        if c.same_host_socket is None:
            raise RuntimeError("the daemon's same-host channel is not in use")
        rng = np.random.default_rng(0)
        src = c.shared_buffer(pool_values * size)
        src[:] = rng.integers(0, 256, src.size, dtype=np.uint8)
        values = [src[i * size : (i + 1) * size] for i in range(pool_values)]
        keys = [os.urandom(16) for _ in range(n_keys)]
        res = c.put_many(keys, [values[i % pool_values].data for i in range(n_keys)])
        if res.stored != n_keys:
            raise RuntimeError(f"working set not stored: {res}")
        check = c.shared_buffer(size)
        for i, k in enumerate(keys):  # every byte verified once
            if c.get_into([k], check).nbytes != size or not np.array_equal(
                check, values[i % pool_values]
            ):
                raise RuntimeError("same-host get returned wrong bytes")
        # A request's fixed cost: one same-host round trip that moves no bytes.
        probe = [keys[0]]
        lat = []
        for _ in range(500):
            t0 = time.perf_counter()
            c.lookup(probe)
            lat.append(time.perf_counter() - t0)
        lookup_us = round(statistics.median(lat[50:]) * 1e6, 1)
        first_ms, next_ms = _first_use(c, keys[:batch], step)
        print(
            f"same-host {size // MiB} MiB x {batch}: a get into a buffer just made "
            f"{first_ms} ms, the next get into it {next_ms} ms",
            flush=True,
        )
        # The baseline's destination: a ring larger than the caches, like the tier's arena.
        ring = np.ones((max(4, 64 * MiB // step), step), dtype=np.uint8)
        # Destinations made and faulted in before any timing, one per thread of the widest
        # run. (Made per pool thread on first use, the first get or memcpy of a thread new to
        # a run paid the page faults of a fresh region, which showed as the get p99.)
        # Ops in flight at once use different ones; an overlap would only mix garbage.
        dsts = [c.shared_buffer(step) for _ in range(max(concs))]
        for buf in dsts:
            buf.fill(0)

        def dst(i: int) -> Any:
            return dsts[i % len(dsts)]

        def k_get(i: int) -> int:
            g = i % groups
            got = c.get_into(keys[g * batch : (g + 1) * batch], dst(i))
            if got.nbytes != step:
                raise RuntimeError("same-host get missed")
            return step

        def m_get(i: int) -> int:
            np.copyto(dst(i), ring[i % len(ring)])
            return step

        def m_put(i: int) -> int:
            np.copyto(ring[i % len(ring)], src[:step])
            return step

        for conc in concs:
            n_ops = max(4 * conc, target_bytes // step)
            runs: dict[tuple[str, str], list[Any]] = {}
            for rep in range(repeats + 1):  # the first round is a warm-up
                fresh = [os.urandom(16) for _ in range(n_ops * batch)]

                def k_put(i: int, fresh: list[bytes] = fresh) -> int:
                    if batch == 1:
                        r = c.put(fresh[i], values[i % pool_values].data)
                    else:
                        r = c.put_many(
                            fresh[i * batch : (i + 1) * batch], [v.data for v in values[:batch]]
                        )
                    if r.stored != batch:
                        raise RuntimeError(f"same-host put not stored: {r}")
                    return step

                order: list[tuple[str, str, Callable[[int], int]]] = [
                    ("get", "kvtier", k_get),
                    ("get", "memcpy", m_get),
                    ("put", "kvtier", k_put),
                    ("put", "memcpy", m_put),
                ]
                for op, who, fn in order if rep % 2 == 0 else order[::-1]:
                    run = drive_cpu(fn, n_ops, conc, pool, proc.pid)
                    if rep:
                        runs.setdefault((op, who), []).append(run)
                for k in fresh:  # untimed: the tier never fills up
                    c.delete(k)
            for op in ("get", "put"):
                k_runs, m_runs = runs[(op, "kvtier")], runs[(op, "memcpy")]
                rows.append(
                    {
                        "op": f"same_host_{op}",
                        "value_bytes": size,
                        "batch": batch,
                        "concurrency": conc,
                        **versus(k_runs, m_runs, "memcpy", ratio_key="ratio_memcpy"),
                        # Where a request's time goes: CPU of the daemon and of this
                        # process per request, against the baseline's per copy.
                        "daemon_cpu_us_per_op": _cpu_us(k_runs, n_ops, server=True),
                        "client_cpu_us_per_op": _cpu_us(k_runs, n_ops, server=False),
                        "memcpy_cpu_us_per_op": _cpu_us(m_runs, n_ops, server=False),
                        "lookup_round_trip_us": lookup_us,
                        "first_get_new_buffer_ms": first_ms,
                        "next_get_same_buffer_ms": next_ms,
                        "ops_per_run": n_ops,
                        "repeats": repeats,
                        "arena_bytes": capacity,
                        "daemon_shared_resident_bytes_at_start": resident,
                    }
                )
    finally:
        c.close()
        stop_process(proc)
    return rows


def _cpu_us(runs: list[Run], n_ops: int, *, server: bool) -> float:
    per = [(r.server_cpu_s if server else r.client_cpu_s) / n_ops for r in runs]
    median: float = statistics.median(per)
    return round(median * 1e6, 1)


def _resident_shared_bytes(pid: int) -> int | None:
    """The process's shared memory in RAM (``RssShmem``), or None where /proc lacks it."""
    try:
        for text in Path(f"/proc/{pid}/status").read_text().splitlines():
            if text.startswith("RssShmem:"):
                return int(text.split()[1]) * 1024
    except OSError:
        pass
    return None


def _first_use(c: Any, keys: list[bytes], nbytes: int, n: int = 3) -> tuple[float, float]:
    """Median ms of the first get into a shared buffer just made, and of the next get
    into the same buffer, over ``n`` new buffers: what a client's first use of new
    shared memory pays beyond a warm one (the daemon's mapping of it, page faults)."""
    first: list[float] = []
    nxt: list[float] = []
    for _ in range(n):
        buf = c.shared_buffer(nbytes)
        for out in (first, nxt):
            t0 = time.perf_counter()
            got = c.get_into(keys, buf)
            out.append(time.perf_counter() - t0)
            if got.nbytes != nbytes:
                raise RuntimeError("same-host get missed")
    return round(statistics.median(first) * 1e3, 3), round(statistics.median(nxt) * 1e3, 3)


def line(r: dict[str, Any]) -> str:
    return (
        f"{r['op']:14} {r['value_bytes'] // MiB:>4}Mi {r.get('batch', 1):>5} {r['concurrency']:>4} "
        f"{r['kvtier_GBps']:>11.3f} {r['memcpy_GBps']:>10.3f} {r['ratio_memcpy']:>6.2f} "
        f"{r['p50_ms']:>8.3f} {r['p99_ms']:>8.3f} {r['memcpy_p50_ms']:>10.3f} "
        f"{r['daemon_cpu_us_per_op']:>9.1f} {r['client_cpu_us_per_op']:>9.1f} "
        f"{r['memcpy_cpu_us_per_op']:>10.1f}"
    )


HEADER = (
    f"{'op':14} {'value':>6} {'batch':>5} {'conc':>4} {'kvtier GB/s':>11} {'memcpy GB/s':>10} {'ratio':>6} "
    f"{'p50 ms':>8} {'p99 ms':>8} {'memcpy p50':>10} {'daemon us':>9} {'client us':>9} "
    f"{'memcpy us':>10}"
)


def socket_floor_us(n: int = 2000, cpus: tuple[int, int] | None = None) -> float:
    """Median round trip of a 48-byte message to another Python process and back over a
    Unix seqpacket socket: the least any same-host request can cost on this machine (two
    process wake-ups), measured in the same run as the rows.

    ``cpus``: run this thread on the first CPU and the echoing process on the second for
    the measurement. Where the scheduler puts the two matters: a wake-up on another CPU
    can cost many times one on the same CPU, so an unpinned figure only says where the
    processes happened to run.
    """
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    echo = (
        "import os,socket,sys\n"
        "if len(sys.argv) > 2: os.sched_setaffinity(0, {int(sys.argv[2])})\n"
        "s=socket.socket(fileno=int(sys.argv[1]))\n"
        "while m:=s.recv(4096): s.send(m)"
    )
    argv = [sys.executable, "-c", echo, str(b.fileno())]
    if cpus is not None:
        argv.append(str(cpus[1]))
    child = subprocess.Popen(argv, pass_fds=[b.fileno()])
    b.close()
    mine = os.sched_getaffinity(0)
    lat = []
    try:
        if cpus is not None:
            os.sched_setaffinity(0, {cpus[0]})  # this thread only, until restored below
        for _ in range(n):
            t0 = time.perf_counter()
            a.send(b"x" * 48)
            a.recv(4096)
            lat.append(time.perf_counter() - t0)
    finally:
        os.sched_setaffinity(0, mine)
        a.close()
        child.wait(10)
    return round(statistics.median(lat[n // 10 :]) * 1e6, 1)


FLOOR_KEYS = (
    "socket_round_trip_floor_us",
    "socket_round_trip_one_cpu_us",
    "socket_round_trip_two_cpus_us",
)


def socket_floors_us() -> dict[str, float | None]:
    """The round-trip floor unpinned, with both processes on one CPU, and on two CPUs
    (None where this process may use only one)."""
    allowed = sorted(os.sched_getaffinity(0))
    two = (allowed[0], allowed[1]) if len(allowed) > 1 else None
    unpinned, one, both = FLOOR_KEYS
    return {
        unpinned: socket_floor_us(),
        one: socket_floor_us(cpus=(allowed[0], allowed[0])),
        both: socket_floor_us(cpus=two) if two else None,
    }


def summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    ratios = [r["ratio_memcpy"] for r in rows]
    floors = socket_floors_us() if rows else dict.fromkeys(FLOOR_KEYS)
    return {
        **floors,
        "target_ratio": TARGET_RATIO,
        "min_ratio": min(ratios) if ratios else None,
        "median_ratio": round(statistics.median(ratios), 3) if ratios else None,
        "points_meeting_target": sum(x >= TARGET_RATIO for x in ratios),
        "points": len(ratios),
    }
