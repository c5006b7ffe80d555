"""The independent-client rows of ``kvtier bench daemon``: C load tools, no project code
on the client side.

kvtier's own client and redis-py cost far more per request than either server at small
values, so the rows of :mod:`.daemon` mostly compare two Python clients there. These rows
take both clients out: ApacheBench (``ab -k``, HTTP/1.0 keep-alive, Debian's
``apache2-utils``) GETs one stored chunk from ``kvtier serve``, and ``redis-benchmark``
(Debian's ``redis-tools``) GETs one value of the same size from ``redis-server``, at the
same concurrency, on this machine, runs of the two interleaved. Both tools are
single-threaded C programs over persistent connections, so what differs is the server's
cost per request.

Rows: ``{op: ab_get, value_bytes, concurrency, kvtier_rps, redis_rps, ratio,
kvtier_rps_min_max, redis_rps_min_max, cpu_us_per_get: {kvtier_server, redis_server},
requests_per_run, repeats}`` (medians over repeats; ``ratio`` = kvtier / redis requests
per second). The servers' CPU per GET (all threads, from ``/proc/PID/task/*/schedstat``)
is what load on a shared machine disturbs least.

Only GETs: ``ab`` sends one body to one URL, so its PUTs after the first would find the
key present, where ``SET`` overwrites; such a row would compare different work.
"""

from __future__ import annotations

import csv
import importlib.util
import io
import os
import re
import shutil
import statistics
import subprocess
from pathlib import Path
from typing import Any

from kvtier.bench._daemon_load import cpu_ns, start_kvtier, stop_process

KiB = 1024
MiB = 1024 * KiB
SIZES = (256 * KiB, 1 * MiB, 4 * MiB, 16 * MiB)
CONCURRENCY = (1, 16)
TARGETS = {"from_1MiB": 0.8, "at_256KiB": 0.5}
KEY = "5ca1ab1e0ddba11c0ffee15900d15ea5"
HEADER = (
    f"{'op':9} {'value':>8} {'conc':>4} {'kvtier req/s':>12} {'redis req/s':>11} {'ratio':>6} "
    f"{'kv cpu us':>9} {'redis cpu us':>12}"
)


def missing_tools() -> str | None:
    """Why these rows cannot run here, or None."""
    for tool, package in (("ab", "apache2-utils"), ("redis-benchmark", "redis-tools")):
        if shutil.which(tool) is None:
            return f"{tool} not found (Debian package {package}; scripts/setup.sh test)"
    # The redis-server these rows start is checked ready through redis-py.
    if importlib.util.find_spec("redis") is None:
        return "redis is not installed (pip install 'kvtier[redis]')"
    return None


def _run(cmd: list[str], pid: int) -> tuple[str, float]:
    """Output of ``cmd`` and the CPU seconds server ``pid`` spent while it ran."""
    c0 = cpu_ns(pid)
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600, check=False)
    cpu_s = (cpu_ns(pid) - c0) / 1e9
    if out.returncode != 0:
        raise RuntimeError(f"{cmd[0]} failed ({out.returncode}): {out.stderr[-2000:]}")
    return out.stdout, cpu_s


def _field(text: str, name: str) -> str:
    m = re.search(rf"^{re.escape(name)}:\s+(\S+)", text, re.MULTILINE)
    if m is None:
        raise RuntimeError(f"ab printed no {name!r}: {text[-2000:]}")
    return m.group(1)


def ab_get(url: str, n: int, conc: int, size: int, pid: int) -> tuple[float, float]:
    """Requests per second of ``ab -k`` GETs of ``url``, and the server's CPU seconds;
    every answer checked (a 200 of ``size`` bytes on a kept-alive connection)."""
    text, cpu_s = _run(["ab", "-q", "-k", "-n", str(n), "-c", str(conc), url], pid)
    if (
        int(_field(text, "Document Length")) != size
        or int(_field(text, "Failed requests")) != 0
        or "Non-2xx responses" in text
        or int(_field(text, "Complete requests")) != n
    ):
        raise RuntimeError(f"ab saw failed, short or non-200 answers: {text[-2000:]}")
    # Persistent connections, as redis-benchmark's: a new connection per request would
    # time connection set-up, not serving.
    if int(_field(text, "Keep-Alive requests")) != n:
        raise RuntimeError(f"the daemon closed kept-alive connections: {text[-2000:]}")
    return float(_field(text, "Requests per second")), cpu_s


def redis_get(port: int, n: int, conc: int, size: int, pid: int) -> tuple[float, float]:
    """Requests per second of ``redis-benchmark -t get`` of one ``size``-byte value (set
    first, untimed), and the server's CPU seconds over the GETs only."""
    base = ["redis-benchmark", "-p", str(port), "-d", str(size), "-c", str(conc), "--csv"]
    _run([*base, "-t", "set", "-n", str(conc)], pid)
    text, cpu_s = _run([*base, "-t", "get", "-n", str(n)], pid)
    for row in csv.DictReader(io.StringIO(text)):
        if row.get("test") == "GET":
            return float(row["rps"]), cpu_s
    raise RuntimeError(f"redis-benchmark printed no GET row: {text[-2000:]}")


def rows_for_size(
    tmp: Path,
    redis_port: int,
    redis_pid: int,
    size: int,
    concs: list[int],
    *,
    target_bytes: int,
    repeats: int,
) -> list[dict[str, Any]]:
    """Start a daemon whose slot is ``size``, store one random value, then time GETs of
    it and of Redis's value at each concurrency (the first round a warm-up)."""
    import httpx

    url, proc = start_kvtier(tmp, "1GiB", max_value_bytes=size)
    rows: list[dict[str, Any]] = []
    try:
        value = os.urandom(size)
        chunk = f"{url}/v1/chunks/{KEY}"
        with httpx.Client(timeout=120) as http:
            http.put(chunk, content=value).raise_for_status()
            got = http.get(chunk)
        if got.status_code != 200 or got.content != value:
            raise RuntimeError("kvtier returned wrong bytes for the stored value")
        for conc in concs:
            n = max(target_bytes // size, 10 * conc)
            runs: dict[str, list[tuple[float, float]]] = {"kvtier": [], "redis": []}
            for rep in range(repeats + 1):
                order = ("kvtier", "redis") if rep % 2 == 0 else ("redis", "kvtier")
                for who in order:
                    if who == "kvtier":
                        run = ab_get(chunk, n, conc, size, proc.pid)
                    else:
                        run = redis_get(redis_port, n, conc, size, redis_pid)
                    if rep:
                        runs[who].append(run)
            k_rps = statistics.median(r for r, _ in runs["kvtier"])
            r_rps = statistics.median(r for r, _ in runs["redis"])
            rows.append(
                {
                    "op": "ab_get",
                    "value_bytes": size,
                    "concurrency": conc,
                    "kvtier_rps": round(k_rps, 1),
                    "redis_rps": round(r_rps, 1),
                    "ratio": round(k_rps / r_rps, 3),
                    "kvtier_rps_min_max": [
                        round(min(r for r, _ in runs["kvtier"]), 1),
                        round(max(r for r, _ in runs["kvtier"]), 1),
                    ],
                    "redis_rps_min_max": [
                        round(min(r for r, _ in runs["redis"]), 1),
                        round(max(r for r, _ in runs["redis"]), 1),
                    ],
                    "cpu_us_per_get": {
                        "kvtier_server": round(
                            statistics.median(c for _, c in runs["kvtier"]) / n * 1e6, 1
                        ),
                        "redis_server": round(
                            statistics.median(c for _, c in runs["redis"]) / n * 1e6, 1
                        ),
                    },
                    "requests_per_run": n,
                    "repeats": repeats,
                }
            )
    finally:
        stop_process(proc)
    return rows


def line(r: dict[str, Any]) -> str:
    c = r["cpu_us_per_get"]
    return (
        f"{r['op']:9} {r['value_bytes'] // KiB:>6}Ki {r['concurrency']:>4} "
        f"{r['kvtier_rps']:>12.1f} {r['redis_rps']:>11.1f} {r['ratio']:>6.2f} "
        f"{c['kvtier_server']:>9.1f} {c['redis_server']:>12.1f}"
    )


def summary(rows: list[dict[str, Any]], skipped: str | None) -> dict[str, Any]:
    """The targets: >= 0.8x redis-server from 1 MiB, >= 0.5x at 256 KiB."""
    big = [r["ratio"] for r in rows if r["value_bytes"] >= MiB]
    small = [r["ratio"] for r in rows if r["value_bytes"] < MiB]
    return {
        "skipped": skipped,
        "targets": TARGETS,
        "min_ratio_from_1MiB": min(big) if big else None,
        "min_ratio_below_1MiB": min(small) if small else None,
        "median_ratio": round(statistics.median(r["ratio"] for r in rows), 3) if rows else None,
        "points": len(rows),
    }
