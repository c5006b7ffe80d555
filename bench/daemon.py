"""The REST daemon against redis-server, moving the same values at the same concurrency.

    kvtier bench daemon --json out.json           # short: a few minutes
    kvtier bench daemon --full --json out.json    # more repeats, more bytes, 60 s soak

Both servers run on this machine in the same invocation: ``kvtier serve`` (uvicorn,
host tier) and ``redis-server`` (no persistence), each on a free loopback port. Both
are driven the same way: ``concurrency`` threads in this process sharing one client
(kvtier's :class:`~kvtier.service.client.Client`, redis-py's ``Redis`` with a pool of
``concurrency`` connections), runs of the two interleaved so drift hits both alike.
Values are random; every value read in the warm-up is compared with what was written.

Rows: ``{op, value_bytes, concurrency, kvtier_GBps, redis_GBps, ratio, p50_ms, p99_ms}``
(medians over repeats; ``ratio`` = kvtier / redis; latencies are kvtier's, Redis's are
in ``redis_p50_ms``/``redis_p99_ms``). ``cpu_ms_per_op``: median CPU per request of
each server process and of this client process (all threads), printed as
``server+client`` ms: per-request cost, which load on a shared machine disturbs far less
than throughput.

The independent-client rows (:mod:`._independent`) take both clients out: ``ab -k``
against ``redis-benchmark``, GETs of one value, the servers' CPU per GET; skipped, with
the reason printed, where either tool is missing.

The soak runs 64 clients against a daemon whose host tier is smaller than the key
space (so puts evict all the time), for ``--soak-s`` seconds: errors, wrong bytes and
the daemon's RSS every second.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvtier.bench import _independent as independent
from kvtier.bench import _same_host as same_host
from kvtier.bench._daemon_load import Run, drive, start_kvtier, stop_process, versus
from kvtier.bench.common import envelope, missing, write_json
from kvtier.bench.redis_procs import RedisServer

KiB = 1024
MiB = 1024 * KiB
SIZES = (256 * KiB, 1 * MiB, 4 * MiB)
CONCURRENCY = (1, 16, 64)
POOL_VALUES = 8  # distinct random values per size, cycled


@dataclass
class Servers:
    kvtier_url: str
    redis_port: int
    kvtier: subprocess.Popen[bytes]
    tmp: Path
    redis_pid: int = 0


def _cpu_s(pid: int) -> float:
    import psutil

    t = psutil.Process(pid).cpu_times()
    return float(t.user + t.system)


def _self_cpu_s() -> float:
    import resource

    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def drive_measured(
    op: Callable[[int], int], n_ops: int, concurrency: int, pool: ThreadPoolExecutor, pid: int
) -> Run:
    """:func:`drive`, with the CPU time of server ``pid`` and of this process."""
    s0, c0 = _cpu_s(pid), _self_cpu_s()
    run = drive(op, n_ops, concurrency, pool)
    s1, c1 = _cpu_s(pid), _self_cpu_s()
    return Run(run.wall_s, run.nbytes, run.latencies_s, s1 - s0, c1 - c0)


def _cpu_per_op(runs: list[Run], n_ops: int, *, server: bool) -> float:
    per: list[float] = [(r.server_cpu_s if server else r.client_cpu_s) / n_ops for r in runs]
    return round(statistics.median(per) * 1e3, 3)


class Contender:
    """put/get of one system, with the key naming that keeps repeats independent."""

    def __init__(
        self,
        name: str,
        put: Callable[[bytes, bytes], None],
        get: Callable[[bytes], bytes | None],
        delete: Callable[[list[bytes]], None],
        get_batch: Callable[[list[bytes]], list[bytes]],
        put_batch: Callable[[list[bytes], list[bytes]], None],
    ) -> None:
        self.name, self.put, self.get, self.delete = name, put, get, delete
        self.get_batch, self.put_batch = get_batch, put_batch


def make_contenders(
    servers: Servers, concurrency: int
) -> tuple[Contender, Contender, Callable[[], None]]:
    import redis

    from kvtier.service.client import Client

    # HTTP rows stay HTTP; the same-host channel has rows of its own (_same_host.py).
    kc = Client(servers.kvtier_url, pool=max(concurrency, 4), timeout_s=120, same_host=False)
    rc = redis.Redis(
        connection_pool=redis.BlockingConnectionPool(  # type: ignore[no-untyped-call]
            host="127.0.0.1",
            port=servers.redis_port,
            max_connections=max(concurrency, 4),
            timeout=120,
            # redis-py 8 cuts a socket write at 5 s by default; 64 clients' 32 MiB sets
            # queue longer than that on one server thread. The same 120 s as kvtier's.
            socket_timeout=120,
        )
    )

    def k_put(key: bytes, value: bytes) -> None:
        res = kc.put(key, value)
        if res.stored + res.present != 1:
            raise RuntimeError(f"kvtier put not stored: {res}")

    def k_del(keys: list[bytes]) -> None:
        for key in keys:
            kc.delete(key)

    def r_put(key: bytes, value: bytes) -> None:
        rc.set(key, value)

    def r_get(key: bytes) -> bytes | None:
        out: bytes | None = rc.get(key)  # type: ignore[assignment]
        return out

    def r_del(keys: list[bytes]) -> None:
        for lo in range(0, len(keys), 512):
            rc.delete(*keys[lo : lo + 512])

    local = threading.local()

    def k_get_batch(keys: list[bytes]) -> list[bytes]:
        # get_into a buffer each thread reuses: the connector's path.
        buf = getattr(local, "buf", None)
        if buf is None or len(buf) < len(keys) * 4 * MiB:
            buf = local.buf = bytearray(len(keys) * 4 * MiB)
        got = kc.get_into(keys, buf)
        view = memoryview(buf)
        out, pos = [], 0
        for n in got.value_bytes:
            out.append(view[pos : pos + n])
            pos += n
        return out  # type: ignore[return-value]  # views; compared as bytes below

    def k_put_batch(keys: list[bytes], values: list[bytes]) -> None:
        res = kc.put_many(keys, values)
        if res.stored + res.present != len(keys):
            raise RuntimeError(f"kvtier batch put not stored: {res}")

    def r_get_batch(keys: list[bytes]) -> list[bytes]:
        return list(rc.mget(keys))  # type: ignore[arg-type]

    def r_put_batch(keys: list[bytes], values: list[bytes]) -> None:
        rc.mset(dict(zip(keys, values, strict=True)))

    def close() -> None:
        kc.close()
        rc.close()

    return (
        Contender("kvtier", k_put, kc.get, k_del, k_get_batch, k_put_batch),
        Contender("redis", r_put, r_get, r_del, r_get_batch, r_put_batch),
        close,
    )


def bench_point(
    servers: Servers,
    size: int,
    concurrency: int,
    *,
    target_bytes: int,
    repeats: int,
    pool: ThreadPoolExecutor,
    batch: int = 1,
) -> list[dict[str, Any]]:
    """Rows for get and put of single values (``batch`` 1), or of ``batch`` values per
    request (ops ``batch_get``/``batch_put``: kvtier get_into/put_many, Redis MGET/MSET)."""
    values = [os.urandom(size) for _ in range(POOL_VALUES)]
    n_ops = max(2 * concurrency, target_bytes // (size * batch))
    kv, rd, close = make_contenders(servers, concurrency)
    rows: list[dict[str, Any]] = []
    try:
        # Get: a working set written once (untimed), read by every repeat.
        n_keys = max(min(n_ops, 64), batch)
        get_keys = [os.urandom(16) for _ in range(n_keys)]
        for c in (kv, rd):
            for i, k in enumerate(get_keys):
                c.put(k, values[i % POOL_VALUES])
            for i, k in enumerate(get_keys):  # verify every byte once
                if c.get(k) != values[i % POOL_VALUES]:
                    raise RuntimeError(f"{c.name} returned wrong bytes")
            if batch > 1:
                got = c.get_batch(get_keys[:batch])
                if [bytes(v) for v in got] != [values[i % POOL_VALUES] for i in range(batch)]:
                    raise RuntimeError(f"{c.name} batch get returned wrong bytes")

        def getter(c: Contender) -> Callable[[int], int]:
            def op(i: int) -> int:
                if batch > 1:
                    lo = (i * batch) % (n_keys - batch + 1)
                    got = c.get_batch(get_keys[lo : lo + batch])
                    if len(got) != batch or any(v is None or len(v) != size for v in got):
                        raise RuntimeError(f"{c.name} batch get missed or short")
                    return size * batch
                v = c.get(get_keys[i % n_keys])
                if v is None or len(v) != size:
                    raise RuntimeError(f"{c.name} get missed or short")
                return size

            return op

        def putter(c: Contender, keys: list[bytes]) -> Callable[[int], int]:
            def op(i: int) -> int:
                if batch > 1:
                    ks = keys[i * batch : (i + 1) * batch]
                    c.put_batch(ks, [values[j % POOL_VALUES] for j in range(batch)])
                    return size * batch
                c.put(keys[i], values[i % POOL_VALUES])
                return size

            return op

        results: dict[tuple[str, str], list[Run]] = {}
        for rep in range(repeats + 1):  # the first round is a warm-up
            for c in (kv, rd) if rep % 2 == 0 else (rd, kv):
                pid = servers.kvtier.pid if c is kv else servers.redis_pid
                run = drive_measured(getter(c), n_ops, concurrency, pool, pid)
                if rep:
                    results.setdefault(("get", c.name), []).append(run)
                # Fresh keys for every put round (a present key would be a no-op),
                # removed afterwards, untimed, so the store never fills up.
                keys = [os.urandom(16) for _ in range(n_ops * batch)]
                run = drive_measured(putter(c, keys), n_ops, concurrency, pool, pid)
                c.delete(keys)
                if rep:
                    results.setdefault(("put", c.name), []).append(run)
        for c in (kv, rd):
            c.delete(get_keys)
        for op in ("get", "put"):
            k_runs, r_runs = results[(op, "kvtier")], results[(op, "redis")]
            name = f"batch_{op}" if batch > 1 else op
            rows.append(
                {
                    "op": name,
                    "value_bytes": size,
                    "batch": batch,
                    "concurrency": concurrency,
                    **versus(k_runs, r_runs, "redis"),
                    "kvtier_GBps_min_max": [
                        round(min(r.GBps for r in k_runs), 4),
                        round(max(r.GBps for r in k_runs), 4),
                    ],
                    "redis_GBps_min_max": [
                        round(min(r.GBps for r in r_runs), 4),
                        round(max(r.GBps for r in r_runs), 4),
                    ],
                    # Median CPU per request (ms), server and client side, and what
                    # Redis's pair costs over kvtier's (> 1: kvtier is cheaper).
                    "cpu_ms_per_op": {
                        "kvtier_server": _cpu_per_op(k_runs, n_ops, server=True),
                        "kvtier_client": _cpu_per_op(k_runs, n_ops, server=False),
                        "redis_server": _cpu_per_op(r_runs, n_ops, server=True),
                        "redis_client": _cpu_per_op(r_runs, n_ops, server=False),
                    },
                    "ops_per_run": n_ops,
                    "repeats": repeats,
                }
            )
    finally:
        close()
    return rows


# -- soak --------------------------------------------------------------------------------------


def soak(seconds: float, clients: int, value_bytes: int) -> dict[str, Any]:
    """``clients`` threads put and get over a key space twice the daemon's capacity."""
    import psutil

    from kvtier.errors import KVTierError
    from kvtier.service.client import Client

    capacity = 256 * MiB
    tmp = Path(tempfile.mkdtemp(prefix="kvtier-soak-"))
    url, proc = start_kvtier(tmp, "256MiB", max_value_bytes=value_bytes)
    ps = psutil.Process(proc.pid)
    n_keys = 2 * capacity // value_bytes
    seeds = [os.urandom(value_bytes) for _ in range(POOL_VALUES)]
    keys = [i.to_bytes(16, "little") for i in range(n_keys)]
    stop = threading.Event()
    counts = {"puts": 0, "gets": 0, "hits": 0, "errors": 0, "wrong_bytes": 0}
    lock = threading.Lock()
    errors: list[str] = []
    client = Client(url, pool=clients, timeout_s=120, same_host=False)

    def worker(w: int) -> None:
        import random

        rnd = random.Random(w)
        local = dict.fromkeys(counts, 0)
        while not stop.is_set():
            i = rnd.randrange(n_keys)
            try:
                if rnd.random() < 0.5:
                    client.put(keys[i], seeds[i % POOL_VALUES])
                    local["puts"] += 1
                else:
                    v = client.get(keys[i])
                    local["gets"] += 1
                    if v is not None:
                        local["hits"] += 1
                        if v != seeds[i % POOL_VALUES]:
                            local["wrong_bytes"] += 1
            except KVTierError as exc:
                local["errors"] += 1
                with lock:
                    if len(errors) < 5:
                        errors.append(repr(exc))
        with lock:
            for k, v in local.items():
                counts[k] += v

    rss: list[tuple[float, int]] = []
    try:
        threads = [threading.Thread(target=worker, args=(w,)) for w in range(clients)]
        t0 = time.monotonic()
        for t in threads:
            t.start()
        while (elapsed := time.monotonic() - t0) < seconds:
            rss.append((round(elapsed, 1), ps.memory_info().rss))
            time.sleep(1.0)
        stop.set()
        for t in threads:
            t.join()
        wall = time.monotonic() - t0
        rss.append((round(wall, 1), ps.memory_info().rss))
        stats = client.stats()["store"]
    finally:
        client.close()
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
        shutil.rmtree(tmp, ignore_errors=True)
    warm = [r for t, r in rss if t >= min(10.0, seconds / 3)]
    ops = counts["puts"] + counts["gets"]
    return {
        "seconds": round(wall, 1),
        "clients": clients,
        "value_bytes": value_bytes,
        "capacity_bytes": capacity,
        "key_space_bytes": n_keys * value_bytes,
        **counts,
        "ops_per_s": round(ops / wall, 1),
        "GBps": round(ops * value_bytes / wall / 1e9, 4),
        "dropped_chunks": stats["dropped_chunks"],
        "error_samples": errors,
        "rss_bytes": rss,
        "rss_after_warmup_min_max": [min(warm), max(warm)] if warm else [],
        "rss_growth_after_warmup_bytes": (warm[-1] - warm[0]) if len(warm) > 1 else 0,
    }


# -- main --------------------------------------------------------------------------------------


def _line(r: dict[str, Any]) -> str:
    return (
        f"{r['op']:9} {r['value_bytes'] // KiB:>6}Ki {r['concurrency']:>4} "
        f"{r['kvtier_GBps']:>11.3f} {r['redis_GBps']:>10.3f} {r['ratio']:>6.2f} "
        f"{r['p50_ms']:>8.2f} {r['p99_ms']:>8.2f} "
        f"{r['redis_p50_ms']:>9.2f} {r['redis_p99_ms']:>9.2f}  "
        f"{_cpu_pair(r, 'kvtier'):>11} {_cpu_pair(r, 'redis'):>11}"
    )


def _cpu_pair(r: dict[str, Any], who: str) -> str:
    c = r["cpu_ms_per_op"]
    return f"{c[who + '_server']:.2f}+{c[who + '_client']:.2f}"


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="kvtier bench daemon", description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--full", action="store_true", help="5 repeats, 64 MiB per run, 60 s soak")
    ap.add_argument("--sizes", default=",".join(str(s) for s in SIZES))
    ap.add_argument("--concurrency", default=",".join(str(c) for c in CONCURRENCY))
    ap.add_argument("--repeats", type=int, default=None)
    ap.add_argument("--target-mib", type=int, default=None, help="bytes per timed run, in MiB")
    ap.add_argument("--soak-s", type=float, default=None, help="soak length (0: skip)")
    ap.add_argument("--soak-only", action="store_true", help="skip the Redis comparison")
    ap.add_argument(
        "--same-host-sizes",
        default=",".join(str(s) for s in same_host.SIZES),
        help="value sizes of the same-host (shared memory vs memcpy) rows; '' skips them",
    )
    ap.add_argument("--same-host-only", action="store_true", help="only the same-host rows")
    ap.add_argument(
        "--independent-sizes",
        default=",".join(str(s) for s in independent.SIZES),
        help="value sizes of the independent-client rows (ab -k against redis-benchmark); "
        "'' skips them",
    )
    ap.add_argument(
        "--independent-concurrency",
        default=",".join(str(c) for c in independent.CONCURRENCY),
    )
    ap.add_argument(
        "--independent-only", action="store_true", help="only the independent-client rows"
    )
    ap.add_argument(
        "--batch",
        type=int,
        default=1,
        help="values per request: >1 compares get_into/put_many with MGET/MSET over HTTP, "
        "and with one memcpy of the same bytes over the same-host channel",
    )
    args = ap.parse_args(argv)
    repeats = args.repeats or (5 if args.full else 2)
    target = (args.target_mib or (64 if args.full else 16)) * MiB
    soak_s = args.soak_s if args.soak_s is not None else (60.0 if args.full else 5.0)
    only_other = args.soak_only or args.same_host_only or args.independent_only
    sizes = [] if only_other else [int(s) for s in args.sizes.split(",")]
    sh_sizes = (
        []
        if args.soak_only or args.independent_only
        else [int(s) for s in args.same_host_sizes.split(",") if s]
    )
    ind_sizes = (
        []
        if args.soak_only or args.same_host_only
        else [int(s) for s in args.independent_sizes.split(",") if s]
    )
    ind_concs = [int(c) for c in args.independent_concurrency.split(",")]
    if args.same_host_only or args.independent_only:
        soak_s = 0.0
    concs = [int(c) for c in args.concurrency.split(",")]
    service = "pip install 'kvtier[service]'"
    if any(missing(p, "every daemon row", service) for p in ("fastapi", "uvicorn", "httpx")):
        return 0
    if sizes and (
        missing("redis", "the Redis rows", "pip install 'kvtier[redis]'")
        or missing("psutil", "the Redis rows (their CPU columns)", "pip install psutil")
    ):
        sizes = []
    ind_skipped = independent.missing_tools() if ind_sizes else "not asked for"
    if ind_sizes and ind_skipped is not None:
        print(f"skipping the independent-client rows: {ind_skipped}")
        ind_sizes = []
    if soak_s > 0 and missing("psutil", "the soak (it samples the RSS)", "pip install psutil"):
        soak_s = 0.0

    tmp = Path(tempfile.mkdtemp(prefix="kvtier-bench-daemon-"))
    redis_server = RedisServer(tmp / "redis").start() if sizes or ind_sizes else None
    rows: list[dict[str, Any]] = []
    if sizes:
        print(
            f"{'op':9} {'value':>8} {'conc':>4} {'kvtier GB/s':>11} {'redis GB/s':>10} "
            f"{'ratio':>6} {'p50 ms':>8} {'p99 ms':>8} {'redis p50':>9} {'redis p99':>9}  "
            f"{'kv cpu ms':>11} {'redis cpu':>11}"
        )
    try:
        with ThreadPoolExecutor(max_workers=max(concs)) as pool:
            for size in sizes:
                # One daemon per value size, its slot sized to the value, as deployed
                # (docs/operations.md): a 256 KiB value in a 4 MiB slot wastes 15/16.
                # 1 GiB holds the get working set plus every put round's fresh keys.
                url, kproc = start_kvtier(tmp, "1GiB", max_value_bytes=size)
                assert redis_server is not None and redis_server.proc is not None
                servers = Servers(url, redis_server.port, kproc, tmp, redis_server.proc.pid)
                try:
                    for conc in concs:
                        for row in bench_point(
                            servers,
                            size,
                            conc,
                            target_bytes=target,
                            repeats=repeats,
                            pool=pool,
                            batch=args.batch,
                        ):
                            rows.append(row)
                            print(_line(row), flush=True)
                finally:
                    stop_process(kproc)
        ind_rows: list[dict[str, Any]] = []
        if ind_sizes:
            assert redis_server is not None and redis_server.proc is not None
            print(independent.HEADER)
            for size in ind_sizes:
                for row in independent.rows_for_size(
                    tmp,
                    redis_server.port,
                    redis_server.proc.pid,
                    size,
                    ind_concs,
                    # Requests, not Python threads, are the cost here: 4x the bytes.
                    target_bytes=4 * target,
                    repeats=repeats,
                ):
                    ind_rows.append(row)
                    print(independent.line(row), flush=True)
        sh_rows: list[dict[str, Any]] = []
        if sh_sizes:
            print(same_host.HEADER)
            with ThreadPoolExecutor(max_workers=max(same_host.CONCURRENCY)) as pool:
                for size in sh_sizes:
                    for row in same_host.rows_for_size(
                        tmp,
                        size,
                        list(same_host.CONCURRENCY),
                        target_bytes=target,
                        repeats=repeats,
                        pool=pool,
                        batch=args.batch,
                    ):
                        sh_rows.append(row)
                        print(same_host.line(row), flush=True)
    finally:
        if redis_server is not None:
            redis_server.stop()
        shutil.rmtree(tmp, ignore_errors=True)
    soak_out: dict[str, Any] | None = None
    if soak_s > 0:
        soak_out = soak(soak_s, 64, 1 * MiB)
        print(
            f"soak: {soak_out['seconds']} s, 64 clients, {soak_out['ops_per_s']} ops/s, "
            f"errors {soak_out['errors']}, wrong bytes {soak_out['wrong_bytes']}, "
            f"RSS after warm-up {soak_out['rss_after_warmup_min_max']} B"
        )
    ratios = [r["ratio"] for r in rows]
    summary = {
        "target_ratio": 0.8,
        "min_ratio": min(ratios) if ratios else None,
        "median_ratio": round(statistics.median(ratios), 3) if ratios else None,
        "points_meeting_target": sum(r >= 0.8 for r in ratios),
        "points": len(ratios),
    }
    if rows:
        print(
            f"ratio kvtier/redis: median {summary['median_ratio']}, min {summary['min_ratio']}, "
            f"{summary['points_meeting_target']}/{summary['points']} points >= 0.8"
        )
    ind_summary = independent.summary(ind_rows, ind_skipped)
    if ind_rows:
        print(
            f"independent clients, kvtier/redis-server req/s: min from 1 MiB "
            f"{ind_summary['min_ratio_from_1MiB']}, min below "
            f"{ind_summary['min_ratio_below_1MiB']}, median {ind_summary['median_ratio']}"
        )
    sh_summary = same_host.summary(sh_rows)
    if sh_rows:
        print(
            f"same-host ratio to memcpy: median {sh_summary['median_ratio']}, min "
            f"{sh_summary['min_ratio']}, {sh_summary['points_meeting_target']}/"
            f"{sh_summary['points']} points >= {same_host.TARGET_RATIO}; a bare socket round "
            f"trip between two processes {sh_summary['socket_round_trip_floor_us']} us (on one "
            f"CPU {sh_summary['socket_round_trip_one_cpu_us']} us, on two "
            f"{sh_summary['socket_round_trip_two_cpus_us']} us), a same-host lookup "
            f"{sh_rows[0]['lookup_round_trip_us']} us"
        )
    write_json(
        args.json,
        envelope(
            "daemon",
            rows,
            soak=soak_out,
            summary=summary,
            same_host_rows=sh_rows,
            same_host_summary=sh_summary,
            independent_rows=ind_rows,
            independent_summary=ind_summary,
            settings={"repeats": repeats, "target_bytes": target, "full": args.full},
        ),
    )
    ok = soak_out is None or (soak_out["errors"] == 0 and soak_out["wrong_bytes"] == 0)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
