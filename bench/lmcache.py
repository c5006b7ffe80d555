"""kvtier under LMCache against LMCache's own backends, through the same LMCache engine.

Usage: ``kvtier bench lmcache [--chunks N] [--repeat R] [--store-rounds S] [--json F]``

One real LMCache 0.5.6 engine per backend (Llama-3-8B geometry: 32 layers, 8 KV heads
of 128, bf16, 256-token chunks = 32 MiB each), the same prompt and the same random KV
bytes for every backend, all engines open at once in one process:

* ``kvtier-remote``: ``KVTierRemoteConnector`` to a ``kvtier serve`` daemon whose one
  tier is nvme (``durability = "none"``, buffered I/O);
* ``kvtier-remote-copy``: ``kvtier-remote`` with its load pool off (``shared_bytes = 0``,
  a daemon of its own): loads land in LMCache's memory through one more copy, the path
  before the pool, as a baseline in the same run;
* ``kvtier-remote-host``: the same connector to a daemon whose one tier is host memory;
* ``kvtier-embedded``: ``KVTierStoragePlugin`` with the same nvme tier in-process;
* ``kvtier-embedded-host``: ``KVTierStoragePlugin`` with one host-memory tier in-process;
* ``lmcache-localdisk``: LMCache's ``LocalDiskBackend`` (``local_disk: file://``);
* ``lmcache-fs``: LMCache's ``fs`` remote connector (one file per chunk);
* ``lmcache-redis``: LMCache's ``redis`` remote connector on a real ``redis-server``.

Durability classes: ``kvtier-remote`` (and ``-copy``), ``kvtier-embedded``, ``lmcache-localdisk`` and
``lmcache-fs`` keep chunks in files written through the OS page cache without fsync;
``kvtier-remote-host``, ``kvtier-embedded-host`` and ``lmcache-redis`` keep them in memory.
Each kvtier row is compared with the best LMCache row of its class, and also with the
best LMCache row that behaves as it does across a restart (measured: every chunk kept,
or none; ``LocalDiskBackend`` writes files but keeps none of them). Per backend: store throughput
(``engine.store`` until the backend holds every chunk), once into the empty backend and
then over ``--store-rounds`` fresh prompts once it is warm (each round stores one new
prompt into every backend, the order rotating, and retrieves the main prompt again,
untimed, so that LRU eviction keeps it for the restart check), retrieve throughput (LMCache's
local CPU copy dropped before each retrieve, so bytes come from the backend; every
retrieve checked byte for byte), and the hit rate after destroying the engine and
restarting its backend (daemon or redis-server stopped and started; files left where
they are). Retrieves run in ``--repeat`` rounds after a warm-up, each round one
retrieve per backend in a rotating order, so every backend sees the same moments of a
shared machine's load; a ratio is reported as the median of the per-round ratios with
their min and max. The GPU side is a CPU copy (LMCache's mock GPU connector
plus the copy), the same for every backend.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvtier.bench.common import envelope, free_port, missing, scratch_dir, write_json

LAYERS, HEADS, HEAD_SIZE, CHUNK = 32, 8, 128, 256
TOKEN_BYTES = LAYERS * 2 * HEADS * HEAD_SIZE * 2  # K and V, bf16
STABLE = {"pre_caching_hash_algorithm": "sha256_cbor"}
CAPACITY_PROMPTS = 4  # a kvtier tier's capacity, in prompts
FILL_ROUNDS = CAPACITY_PROMPTS - 1  # untimed stores that fill it (the main prompt is the 4th)


def _nvme_toml(directory: Path, capacity_bytes: int) -> str:
    return "\n".join(
        [
            "[[tiers]]",
            'kind = "nvme"',
            f"capacity_bytes = {capacity_bytes}",
            f'dir = "{directory / "nvme"}"',
            "create_dirs = true",
            'durability = "none"',
            'o_direct = "off"',
            "",
            "[store]",
            'placement = "keep"',
            "",
            "[service]",
            f'data_dir = "{directory}"',
            f"max_value_bytes = {CHUNK * TOKEN_BYTES}",
            f"max_body_bytes = {4 * CHUNK * TOKEN_BYTES}",
            "",
        ]
    )


def _host_toml(capacity_bytes: int) -> str:
    """A daemon whose one tier is host memory (no data_dir: nothing outlives it)."""
    return "\n".join(
        [
            "[[tiers]]",
            'kind = "host"',
            f"capacity_bytes = {capacity_bytes}",
            "",
            "[store]",
            'placement = "keep"',
            "",
            "[service]",
            # Empty, not left out: the default is the user's data directory, where the
            # daemon would add an nvme tier (and this row would no longer be memory).
            'data_dir = ""',
            f"max_value_bytes = {CHUNK * TOKEN_BYTES}",
            f"max_body_bytes = {4 * CHUNK * TOKEN_BYTES}",
            "",
        ]
    )


@dataclass
class _Daemon:
    proc: subprocess.Popen[bytes]
    url: str

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def _serve(directory: Path, port: int) -> _Daemon:
    import httpx

    config = directory / "kvtier.toml"
    log = open(directory / "daemon.log", "ab")  # noqa: SIM115  # the child owns it
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "kvtier.cli.main",
            "serve",
            "--config",
            str(config),
            "--port",
            str(port),
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        # The config file alone decides (a KVTIER_DATA_DIR here would add an nvme tier).
        env={k: v for k, v in os.environ.items() if not k.startswith("KVTIER_")},
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"kvtier daemon exited: see {directory / 'daemon.log'}")
        try:
            if httpx.get(f"{url}/readyz", timeout=1).status_code == 200:
                return _Daemon(proc, url)
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    proc.kill()
    raise RuntimeError("kvtier daemon did not become ready")


class _Engines:
    """Builds LMCache engines over the Llama-3-8B geometry with a copying mock connector."""

    def __init__(self, local_cpu_gb: float) -> None:
        import torch
        from lmcache.v1.gpu_connector.mock_gpu_connector import MockGPUConnector

        os.environ.setdefault("PYTHONHASHSEED", "0")  # vLLM's NONE_HASH derives from it
        self.torch = torch
        self.local_cpu_gb = local_cpu_gb
        self.n = 0
        self.stuck: list[str] = []

        class Copy(MockGPUConnector):  # type: ignore[misc]
            def batched_from_gpu(self, objs: Any, starts: Any, ends: Any, **kw: Any) -> None:
                src = kw["kv"]
                for o, s, e in zip(objs, starts, ends, strict=True):
                    o.byte_array.cast("B")[: (e - s) * TOKEN_BYTES] = (
                        src[s * TOKEN_BYTES : e * TOKEN_BYTES].numpy().data
                    )

            def batched_to_gpu(self, objs: Any, starts: Any, ends: Any, **kw: Any) -> None:
                out = kw["out"]
                for o, s, e in zip(objs, starts, ends, strict=True):
                    n = (e - s) * TOKEN_BYTES
                    out[s * TOKEN_BYTES : e * TOKEN_BYTES].numpy()[:] = o.byte_array.cast("B")[:n]

        self.connector = Copy

    def open(self, config: dict[str, Any]) -> tuple[str, Any]:
        """A new engine over ``config``: (its name, the engine)."""
        from lmcache.v1.cache_engine import LMCacheEngineBuilder
        from lmcache.v1.config import LMCacheEngineConfig
        from lmcache.v1.metadata import LMCacheMetadata

        cfg = LMCacheEngineConfig.from_dict(
            {"chunk_size": CHUNK, "local_cpu": True, "max_local_cpu_size": self.local_cpu_gb}
            | STABLE
            | config
        )
        meta = LMCacheMetadata(
            model_name="meta-llama/Meta-Llama-3-8B",
            world_size=1,
            local_world_size=1,
            worker_id=0,
            local_worker_id=0,
            kv_dtype=self.torch.bfloat16,
            kv_shape=(LAYERS, 2, CHUNK, HEADS, HEAD_SIZE),
            chunk_size=CHUNK,
        )
        self.n += 1
        name = f"kvtier-bench-{os.getpid()}-{self.n}"
        eng = LMCacheEngineBuilder.get_or_create(
            name,
            cfg,
            meta,
            self.connector(kv_shape=meta.kv_shape),
            lambda t, r: None,
            lambda o, r: o,
        )
        eng.post_init()
        return name, eng

    def close(self, name: str) -> None:
        from lmcache.v1.cache_engine import LMCacheEngineBuilder

        # LMCache 0.5.6's redis connector can hang in close(): bound the wait, note
        # it, and go on (main() then exits without waiting for LMCache's threads).
        t = threading.Thread(target=LMCacheEngineBuilder.destroy, args=(name,), daemon=True)
        t.start()
        t.join(60)
        if t.is_alive():
            self.stuck.append(name)
            print(f"  (LMCache did not close engine {name} within 60 s)", flush=True)

    @contextmanager
    def engine(self, config: dict[str, Any]) -> Iterator[Any]:
        name, eng = self.open(config)
        try:
            yield eng
        finally:
            self.close(name)


@dataclass
class _Backend:
    name: str
    durability: str
    config: Callable[[], dict[str, Any]]
    backend: str  # LMCache's name of the storage backend
    restart: Callable[[], None]
    # Runs before the engine is destroyed (the redis row stops its server there: a
    # restart of a memory backend; LMCache's redis connector may still hang in close()).
    before_close: Callable[[], None] = lambda: None


def _wait_held(eng: Any, tokens: list[int], backend: str, timeout_s: float = 120.0) -> int:
    deadline = time.monotonic() + timeout_s
    while True:
        n = int(eng.lookup(tokens, search_range=[backend]))
        if n >= len(tokens) or time.monotonic() > deadline:
            return n
        time.sleep(0.01)


def _store(engines: _Engines, b: _Backend, tokens: list[int], kv: Any) -> dict[str, Any]:
    """Open ``b``'s engine and store the prompt until the backend holds every chunk."""
    nbytes = len(tokens) * TOKEN_BYTES
    row: dict[str, Any] = {"backend": b.name, "durability": b.durability, "bytes": nbytes}
    name, eng = engines.open(b.config())
    row["_engine"] = (name, eng)
    seconds, held = _timed_store(eng, b, tokens, kv)
    row["stored_tokens"] = held
    row["store_GBps"] = nbytes / seconds / 1e9
    row["_times"], row["_got"], row["bytes_equal"] = [], [], True
    row["_store_times"], row["_store_held"] = [], []
    return row


def _timed_store(eng: Any, b: _Backend, tokens: list[int], kv: Any) -> tuple[float, int]:
    """``engine.store`` until the backend holds every chunk: (seconds, tokens held)."""
    t0 = time.perf_counter()
    eng.store(tokens, kv=kv)
    held = _wait_held(eng, tokens, b.backend)
    return time.perf_counter() - t0, held


def _store_round(
    engines: _Engines,
    pairs: list[tuple[_Backend, dict[str, Any]]],
    fresh: list[int],
    tokens: list[int],
    kv: Any,
    *,
    timed: bool,
) -> None:
    """Store the prompt ``fresh`` (never stored before) into every backend, recording the
    time when ``timed``; after each, retrieve the main prompt once, untimed and checked,
    so that it stays recently used (kept by LRU eviction for the restart check)."""
    for b, row in pairs:
        seconds, held = _timed_store(row["_engine"][1], b, fresh, kv)
        if timed:
            row["_store_times"].append(seconds)
            row["_store_held"].append(held)
        _retrieve(engines, row, tokens, kv)
        row["_got"].pop()  # not a timed retrieve; its bytes were checked all the same


def _retrieve(engines: _Engines, row: dict[str, Any], tokens: list[int], kv: Any) -> float:
    """One retrieve from the backend (LMCache's local CPU copy dropped first); seconds."""
    torch = engines.torch
    eng = row["_engine"][1]
    eng.clear(locations=["LocalCPUBackend"])
    out = torch.zeros(len(tokens) * TOKEN_BYTES, dtype=torch.uint8)
    t0 = time.perf_counter()
    mask = eng.retrieve(tokens, out=out)
    dt = time.perf_counter() - t0
    n = int(mask.sum()) * TOKEN_BYTES
    # Correctness over what came back; a short retrieve shows in retrieved_tokens.
    row["bytes_equal"] = row["bytes_equal"] and bool(torch.equal(out[:n], kv[:n]))
    row["_got"].append(n // TOKEN_BYTES)
    return dt


def _finish(engines: _Engines, b: _Backend, row: dict[str, Any], tokens: list[int]) -> None:
    """Summarise the retrieves, close the engine, restart the backend, look up again."""
    times, got = row.pop("_times"), row.pop("_got")
    store_times, store_held = row.pop("_store_times"), row.pop("_store_held")
    if store_times:
        row["store_rounds_s"] = store_times
        row["store_rounds_complete"] = min(store_held) == len(tokens)
        row["store_steady_GBps"] = row["bytes"] / statistics.median(store_times) / 1e9
    row["retrieved_tokens"] = min(got)
    row["complete"] = row["stored_tokens"] == len(tokens) and min(got) == len(tokens)
    row["retrieve_s"] = {
        "median": statistics.median(times),
        "min": min(times),
        "max": max(times),
        "all": times,
    }
    row["retrieve_GBps"] = min(got) * TOKEN_BYTES / row["retrieve_s"]["median"] / 1e9
    b.before_close()
    engines.close(row.pop("_engine")[0])
    b.restart()
    with engines.engine(b.config()) as eng:
        hit = int(eng.lookup(tokens))
    row["hit_rate_after_restart"] = hit / len(tokens)


def _restart_ratios(rows: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Retrieve ratios, each kvtier row against the fastest LMCache row (median
    retrieve) that behaved as it did across the restart: kept every chunk, or none.
    Rows that kept some but not all are in neither group."""
    out: dict[str, dict[str, float]] = {}
    for kept in (True, False):
        group = [
            r
            for r in rows
            if r["complete"] and r["hit_rate_after_restart"] == (1.0 if kept else 0.0)
        ]
        theirs = [r for r in group if r["backend"].startswith("lmcache-")]
        if not theirs:
            continue
        best = max(theirs, key=lambda r: r["retrieve_GBps"])["backend"]
        label = "kept at restart" if kept else "lost at restart"
        for ours in (r["backend"] for r in group if r["backend"].startswith("kvtier-")):
            out[f"{ours}_retrieve_vs_{best} ({label})"] = _round_ratios(rows, ours, best)
    return out


def _store_ratios(rows: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Steady-state store ratios, kvtier row / LMCache row of the same durability class,
    per store round (one round's stores run back to back, so they meet the same load)."""
    out: dict[str, dict[str, float]] = {}
    for ours in rows:
        for theirs in rows:
            if not (
                ours["backend"].startswith("kvtier-")
                and theirs["backend"].startswith("lmcache-")
                and ours["durability"] == theirs["durability"]
                and ours.get("store_rounds_complete")
                and theirs.get("store_rounds_complete")
            ):
                continue
            out[f"{ours['backend']}_store_vs_{theirs['backend']}"] = _per_round(
                ours["store_rounds_s"], theirs["store_rounds_s"]
            )
    return out


def _per_round(ours_s: list[float], theirs_s: list[float]) -> dict[str, float]:
    """Throughput ratio ours/theirs from the seconds of the same rounds: the median of
    the per-round ratios, their min and max, and the ratio of the medians."""
    per = [tb / ta for ta, tb in zip(ours_s, theirs_s, strict=True)]
    return {
        "median": statistics.median(per),
        "min": min(per),
        "max": max(per),
        "of_medians": statistics.median(theirs_s) / statistics.median(ours_s),
    }


def _verify_s(kv: Any) -> float:
    """Seconds of the check kvtier's nvme tier does on every read and LMCache's file
    backends do not: one xxh3_64 per chunk over the same bytes (a reference figure)."""
    import xxhash

    view = kv.numpy().data
    step = CHUNK * TOKEN_BYTES
    t0 = time.perf_counter()
    for off in range(0, len(view), step):
        xxhash.xxh3_64_intdigest(view[off : off + step])
    return time.perf_counter() - t0


def _round_ratios(rows: list[dict[str, Any]], ours: str, theirs: str) -> dict[str, float]:
    """Retrieve-throughput ratio ours/theirs per round (same round = same moment's load)."""
    a = next(r for r in rows if r["backend"] == ours)
    b = next(r for r in rows if r["backend"] == theirs)
    if not (a["complete"] and b["complete"]):
        # A retrieve that came back short is not the same work: no throughput ratio.
        nan = float("nan")
        return {"median": nan, "min": nan, "max": nan, "of_medians": nan}
    return _per_round(a["retrieve_s"]["all"], b["retrieve_s"]["all"])


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="kvtier bench lmcache", description=__doc__.split("\n")[0])
    ap.add_argument(
        "--chunks", type=int, default=8, help="256-token chunks per prompt (32 MiB each)"
    )
    ap.add_argument("--repeat", type=int, default=5, help="timed retrieves per backend")
    ap.add_argument(
        "--store-rounds",
        type=int,
        default=5,
        help="timed stores of fresh prompts per backend once it is warm (0: none)",
    )
    ap.add_argument("--only", action="append", help="run only these backends (repeatable)")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    if missing("lmcache", "every lmcache row", "pip install 'kvtier[lmcache]'"):
        return 0
    import torch

    from kvtier.bench.redis_procs import RedisServer

    nbytes = args.chunks * CHUNK * TOKEN_BYTES
    engines = _Engines(local_cpu_gb=max(0.5, 2.5 * nbytes / 2**30))
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 120000, (args.chunks * CHUNK,), generator=g).tolist()
    kv = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=g)

    # Up to gigabytes of slabs, files and logs: removed at the end (below; at exit
    # otherwise), whatever happens.
    tmp = scratch_dir("kvtier-bench-lmcache-")
    capacity = CAPACITY_PROMPTS * nbytes
    (tmp / "daemon").mkdir()
    (tmp / "daemon" / "kvtier.toml").write_text(_nvme_toml(tmp / "daemon", capacity))
    (tmp / "embedded").mkdir()
    (tmp / "embedded" / "kvtier.toml").write_text(_nvme_toml(tmp / "embedded", capacity))
    (tmp / "daemon-copy").mkdir()
    (tmp / "daemon-copy" / "kvtier.toml").write_text(_nvme_toml(tmp / "daemon-copy", capacity))
    (tmp / "daemon-host").mkdir()
    (tmp / "daemon-host" / "kvtier.toml").write_text(_host_toml(capacity))
    (tmp / "embedded-host").mkdir()
    (tmp / "embedded-host" / "kvtier.toml").write_text(_host_toml(capacity))
    port, host_port, copy_port = free_port(), free_port(), free_port()
    state: dict[str, Any] = {"daemon": _serve(tmp / "daemon", port)}
    state["daemon-copy"] = _serve(tmp / "daemon-copy", copy_port)
    state["daemon-host"] = _serve(tmp / "daemon-host", host_port)
    redis = RedisServer(tmp / "redis").start()
    state["redis"] = redis

    def restart_daemon() -> None:
        state["daemon"].stop()
        state["daemon"] = _serve(tmp / "daemon", port)

    def restart_copy_daemon() -> None:
        state["daemon-copy"].stop()
        state["daemon-copy"] = _serve(tmp / "daemon-copy", copy_port)

    def restart_host_daemon() -> None:
        state["daemon-host"].stop()
        state["daemon-host"] = _serve(tmp / "daemon-host", host_port)

    def stop_redis() -> None:
        state["redis"].stop()

    def restart_redis() -> None:
        state["redis"] = RedisServer(tmp / "redis", port=redis.port).start()

    def nothing() -> None:
        return None

    def embedded(folder: str) -> dict[str, Any]:
        """The storage plug-in over the kvtier config in ``tmp / folder``."""
        return {
            "storage_plugins": ["kvtier"],
            "extra_config": {
                "storage_plugin.kvtier.module_path": "kvtier.connectors.lmcache",
                "storage_plugin.kvtier.class_name": "KVTierStoragePlugin",
                "storage_plugin.kvtier.config_file": str(tmp / folder / "kvtier.toml"),
            },
        }

    def remote(daemon: str, **extra: Any) -> dict[str, Any]:
        return {
            "remote_storage_plugins": ["kvtier"],
            "extra_config": {
                "remote_storage_plugin.kvtier.module_path": "kvtier.connectors.lmcache",
                "remote_storage_plugin.kvtier.class_name": "KVTierRemoteConnector",
                "remote_storage_plugin.kvtier.url": state[daemon].url,
                "remote_storage_plugin.kvtier.timeout_s": 60.0,
                **{f"remote_storage_plugin.kvtier.{k}": v for k, v in extra.items()},
            },
        }

    disk_gb = 2 * nbytes / 2**30
    backends = [
        _Backend(
            "kvtier-remote",
            "files, no fsync",
            lambda: remote("daemon"),
            "RemoteBackend-kvtier",
            restart_daemon,
        ),
        _Backend(
            "kvtier-remote-copy",
            "files, no fsync",
            lambda: remote("daemon-copy", shared_bytes=0),
            "RemoteBackend-kvtier",
            restart_copy_daemon,
        ),
        _Backend(
            "kvtier-remote-host",
            "memory",
            lambda: remote("daemon-host"),
            "RemoteBackend-kvtier",
            restart_host_daemon,
        ),
        _Backend(
            "kvtier-embedded", "files, no fsync", lambda: embedded("embedded"), "kvtier", nothing
        ),
        _Backend(
            "kvtier-embedded-host", "memory", lambda: embedded("embedded-host"), "kvtier", nothing
        ),
        _Backend(
            "lmcache-localdisk",
            "files, no fsync",
            lambda: {"local_disk": f"file://{tmp / 'localdisk'}/", "max_local_disk_size": disk_gb},
            "LocalDiskBackend",
            nothing,
        ),
        _Backend(
            "lmcache-fs",
            "files, no fsync",
            lambda: {
                "remote_storage_plugins": ["fs"],
                "extra_config": {"remote_storage_plugin.fs.base_path": str(tmp / "fs")},
            },
            "RemoteBackend-fs",
            nothing,
        ),
        _Backend(
            "lmcache-redis",
            "memory",
            lambda: {"remote_url": state["redis"].url.rsplit("/", 1)[0]},
            "RemoteBackend",
            restart_redis,
            stop_redis,
        ),
    ]
    chosen = [b for b in backends if not args.only or b.name in args.only]
    rows: list[dict[str, Any]] = []
    verify: list[float] = []
    try:
        for b in chosen:
            rows.append(_store(engines, b, tokens, kv))
            print(f"{b.name:18} store {rows[-1]['store_GBps']:6.2f} GB/s", flush=True)
        for r in rows:  # warm-up, not timed
            _retrieve(engines, r, tokens, kv)
        # Round-robin: each round retrieves once from every backend, the order rotating,
        # so all backends see the same moments of this shared machine's load.
        for k in range(args.repeat):
            for r in rows[k % len(rows) :] + rows[: k % len(rows)]:
                r["_times"].append(_retrieve(engines, r, tokens, kv))
            verify.append(_verify_s(kv))
        # Steady-state stores: a fresh prompt per round into every backend, the order
        # rotating as above. The first store (above) wrote into an empty backend; the
        # FILL_ROUNDS untimed ones fill the bounded backends (kvtier's tiers hold
        # CAPACITY_PROMPTS prompts, LocalDiskBackend two), so the timed ones store into
        # a full backend that evicts, as a serving cache does.
        pairs = list(zip(chosen, rows, strict=True))
        fill = FILL_ROUNDS if args.store_rounds else 0
        for k in range(fill + args.store_rounds):
            fresh = torch.randint(0, 120000, (len(tokens),), generator=g).tolist()
            order = pairs[k % len(pairs) :] + pairs[: k % len(pairs)]
            _store_round(engines, order, fresh, tokens, kv, timed=k >= fill)
        for b, r in zip(chosen, rows, strict=True):
            _finish(engines, b, r, tokens)
            print(
                f"{r['backend']:18} retrieve {r['retrieve_GBps']:6.2f} GB/s  "
                f"complete {r['complete']}  bytes equal {r['bytes_equal']}  "
                f"hits after restart {r['hit_rate_after_restart']:.0%}",
                flush=True,
            )
            if "store_steady_GBps" in r:
                print(
                    f"{r['backend']:18} store, steady {r['store_steady_GBps']:6.2f} GB/s "
                    f"(median of {len(r['store_rounds_s'])} fresh prompts; first store "
                    f"{r['store_GBps']:.2f})",
                    flush=True,
                )
    finally:
        for r in rows:
            if "_engine" in r:
                engines.close(r.pop("_engine")[0])
        state["daemon"].stop()
        state["daemon-copy"].stop()
        state["daemon-host"].stop()
        state["redis"].stop()
        # Explicitly too: os._exit below (LMCache's stuck threads) skips exit handlers.
        shutil.rmtree(tmp, ignore_errors=True)
    ratios: dict[str, dict[str, float]] = {}
    disk = [
        r
        for r in rows
        if r["durability"].startswith("files") and r["backend"].startswith("lmcache")
    ]
    names = {r["backend"] for r in rows}
    if disk:
        best = max(disk, key=lambda r: r["retrieve_GBps"])
        for ours in ("kvtier-remote", "kvtier-embedded"):
            if ours in names:
                ratios[f"{ours}_retrieve_vs_{best['backend']}"] = _round_ratios(
                    rows, ours, best["backend"]
                )
    if "lmcache-fs" in names:  # the file backend that, like kvtier's, keeps chunks at restart
        for ours in ("kvtier-remote", "kvtier-embedded"):
            if ours in names and best["backend"] != "lmcache-fs":
                ratios[f"{ours}_retrieve_vs_lmcache-fs"] = _round_ratios(rows, ours, "lmcache-fs")
    if {"kvtier-remote", "kvtier-remote-copy"} <= names:  # what the load pool saves
        ratios["kvtier-remote_retrieve_vs_kvtier-remote-copy"] = _round_ratios(
            rows, "kvtier-remote", "kvtier-remote-copy"
        )
    if "lmcache-redis" in names:  # the memory class: LMCache's redis connector
        for ours in ("kvtier-remote-host", "kvtier-embedded-host", "kvtier-remote"):
            if ours in names:
                ratios[f"{ours}_retrieve_vs_lmcache-redis"] = _round_ratios(
                    rows, ours, "lmcache-redis"
                )
    by_restart = _restart_ratios(rows)
    store_ratios = _store_ratios(rows)
    for what, v in [*ratios.items(), *by_restart.items(), *store_ratios.items()]:
        print(
            f"{what}: {v['median']:.2f}x (per-round median; min {v['min']:.2f}, max "
            f"{v['max']:.2f}; ratio of medians {v['of_medians']:.2f})"
        )
    verified = all(r["bytes_equal"] for r in rows)
    verify_s = statistics.median(verify) if rows and args.repeat else None
    if verify_s:
        print(
            f"xxh3 over the prompt's bytes (kvtier's read check): {nbytes / verify_s / 1e9:.2f} GB/s"
        )
    payload = envelope(
        "lmcache",
        rows,
        ratios=ratios,
        ratios_by_restart=by_restart,
        store_ratios=store_ratios,
        store_rounds=args.store_rounds,
        verified=verified,
        chunks=args.chunks,
        repeat=args.repeat,
        checksum_s=verify_s,
    )
    write_json(args.json, {**payload, "engines_not_closed": engines.stuck})
    rc = 0 if verified else 1
    if engines.stuck:  # LMCache's stuck threads would keep the interpreter from exiting
        sys.stdout.flush()
        os._exit(rc)
    return rc


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
