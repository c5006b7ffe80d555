"""The redis tier against raw redis-py and against LMCache's two-keys-per-chunk scheme.

One long sequence (default: 32K tokens of Qwen2-7B's KV on one TP-4 rank, 256-token
chunks: 128 values of 3.5 MiB, 448 MiB) is put and got, batch at a time:

* ``kvtier``  -- :class:`~kvtier.tiers.redis.RedisTier` ``write``/``read`` of the run:
  one value per chunk (header + payload, checksummed), pipelined per node in batches
  bounded by bytes, nodes in parallel;
* ``ceiling`` -- raw redis-py, pipelined ``SET``/``GET`` of the same bytes with no header,
  no checksum, in the same byte-bounded batches, every master at once; reads are copied
  into the same destination buffer;
* ``twokey``  -- LMCache's Redis connector design: a metadata key and a data key per
  chunk, each chunk in two round trips, chunk after chunk.

Each target is a local ``redis-server`` started here (no persistence) and a local
3-master Redis Cluster; pass ``--url``/``--cluster-nodes`` to use running ones instead.
Contenders run interleaved; figures are medians with min and max, bytes verified.
``cpu_x_ceiling`` is the ceiling's median CPU time per run over kvtier's (this process,
every thread): > 1 when kvtier spends less; steadier than wall time on a shared machine.

Run: ``kvtier bench redis --json F`` (``--tokens``, ``--model``, ``--tp``, ``--repeat``).
"""

from __future__ import annotations

import argparse
import statistics
import struct
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import numpy as np
import numpy.typing as npt

from kvtier.bench.common import Sample, envelope, interleaved, missing, write_json
from kvtier.keys import ChunkKey
from kvtier.spec import preset
from kvtier.tiers.base import SlotRun, TierGeometry
from kvtier.units import MiB

STREAMS = [2]
CHUNK_TOKENS = [256]
BATCH_BYTES = [8 * MiB]  # set from --batch-bytes; the tier and the ceiling batch alike
KEY_FILE = [""]  # master key of the kvtier+aes contender; empty without cryptography


Fn = Callable[[], object]


def _batches(idx: list[int], item_bytes: int) -> list[list[int]]:
    per = max(1, BATCH_BYTES[0] // item_bytes)
    return [idx[i : i + per] for i in range(0, len(idx), per)]


class Target:
    """Raw redis-py clients of one deployment (single server or cluster) for the baselines.

    Raw clients get the strongest redis-py configuration: the Python command packer,
    which sends memoryviews without a copy (the hiredis packer copies each value twice),
    and the hiredis reply parser when installed. In a cluster, keys are routed by hash
    slot to one plain client per master, as redis-py's cluster client does.
    """

    def __init__(self, name: str, url: str | None, seeds: tuple[str, ...]) -> None:
        import redis
        from redis.connection import PythonRespSerializer

        self.name = name
        self.url = url
        self.seeds = seeds

        def client(**kw: Any) -> Any:
            enc = redis.Redis().get_encoder()
            kw.update(socket_timeout=60, command_packer=PythonRespSerializer(6000, enc.encode))
            return redis.Redis(connection_pool=redis.ConnectionPool(**kw))

        self.slots: list[Any] = []
        if seeds:
            host, port = seeds[0].rsplit(":", 1)
            first = client(host=host, port=int(port))
            by_port: dict[int, Any] = {}
            self.slots = [None] * 16384
            for lo, hi, primary, *_ in first.execute_command("CLUSTER", "SLOTS"):
                p = int(primary[1])
                if p not in by_port:
                    by_port[p] = client(host=primary[0].decode(), port=p)
                c = by_port[p]
                self.slots[lo : hi + 1] = [c] * (hi - lo + 1)
            first.close()
            self.nodes = list(by_port.values())
        else:
            parts = urlsplit(url or "")
            self.nodes = [client(host=parts.hostname, port=parts.port or 6379)]

    def route(self, name: bytes) -> Any:
        from redis.crc import key_slot

        return self.slots[key_slot(name)] if self.seeds else self.nodes[0]

    def tier(self, slot_bytes: int, n: int, key_file: str = "") -> Any:
        from kvtier.tiers.redis import Options, RedisTier

        opts = Options(
            url=self.url or "redis://127.0.0.1:6379/0",
            cluster_nodes=self.seeds,
            key_prefix=f"bench-{uuid.uuid4().hex[:8]}",
            op_budget_s=120.0,
            write_budget_s=120.0,
            socket_timeout_s=60.0,
            batch_bytes=BATCH_BYTES[0],
            streams_per_node=STREAMS[0],
            encryption_key_file=key_file,
        )
        if key_file:  # a sealed value carries its nonce and tag
            slot_bytes += 28
        return RedisTier(TierGeometry("redis", 2 * n * slot_bytes, slot_bytes, 1 << 40), opts)

    def flush(self) -> None:
        for c in self.nodes:
            c.flushall()

    def close(self) -> None:
        for c in self.nodes:
            c.close()


def contenders(
    t: Target, keys: list[ChunkKey], data: npt.NDArray[Any], chunk: int
) -> tuple[dict[str, Fn], dict[str, Fn], dict[str, npt.NDArray[Any]], Any]:
    """(put fns, get fns, get destinations, tier) for kvtier, ceiling and twokey."""
    n = len(keys)
    src = data.data
    tier = t.tier(chunk, n)
    exts = tier.allocate(n)
    assert exts is not None and len(exts) == 1, "the bench run must be one extent"
    run = SlotRun(exts[0].offset, tuple(keys), chunk)
    ceil_names = [b"bench-ceil:" + k.hex().encode() for k in keys]
    # Hash tags keep a chunk's two keys in one slot, as LMCache's cluster variant does.
    meta_names = [b"bench-2k:{" + k.hex().encode() + b"}:metadata" for k in keys]
    kv_names = [b"bench-2k:{" + k.hex().encode() + b"}:kv_bytes" for k in keys]
    by_node: dict[int, tuple[Any, list[int]]] = {}
    for i, name in enumerate(ceil_names):
        c = t.route(name)
        by_node.setdefault(id(c), (c, []))[1].append(i)
    groups = list(by_node.values())
    pool = ThreadPoolExecutor(max_workers=len(groups))
    dst = {name: np.zeros_like(data) for name in ("kvtier", "ceiling", "twokey")}
    sealed = None
    if KEY_FILE[0]:  # the same puts and gets with encryption at rest ([encryption])
        sealed = t.tier(chunk, n, KEY_FILE[0])
        sexts = sealed.allocate(n)
        assert sexts is not None and len(sexts) == 1, "the bench run must be one extent"
        srun = SlotRun(sexts[0].offset, tuple(keys), chunk)
        dst["kvtier+aes"] = np.zeros_like(data)

    def kv_put() -> None:
        tier.write(run, src)

    def kv_get() -> None:
        tier.read(run, dst["kvtier"].data)

    def ceil_put_node(c: Any, idx: list[int]) -> None:
        for b in _batches(idx, chunk):
            pipe = c.pipeline(transaction=False)
            for i in b:
                pipe.set(ceil_names[i], src[i * chunk : (i + 1) * chunk])
            pipe.execute()

    def ceil_get_node(c: Any, idx: list[int]) -> None:
        out = dst["ceiling"].data
        for b in _batches(idx, chunk):
            pipe = c.pipeline(transaction=False)
            for i in b:
                pipe.get(ceil_names[i])
            for i, v in zip(b, pipe.execute(), strict=True):
                out[i * chunk : (i + 1) * chunk] = v

    def fan(fn: Callable[[Any, list[int]], None]) -> Fn:
        def run_all() -> None:
            # Every master at once, as the tier does: the ceiling is not held back by a serial loop.
            for f in [pool.submit(fn, c, idx) for c, idx in groups]:
                f.result()

        return run_all

    def twokey_put() -> None:
        for i in range(n):
            c = t.route(kv_names[i])
            c.set(kv_names[i], src[i * chunk : (i + 1) * chunk])
            c.set(meta_names[i], struct.pack("<QQ", chunk, i))

    def twokey_get() -> None:
        out = dst["twokey"].data
        for i in range(n):
            c = t.route(kv_names[i])
            length, _ = struct.unpack("<QQ", c.get(meta_names[i]))
            out[i * chunk : (i + 1) * chunk] = c.get(kv_names[i])[:length]

    puts = {"kvtier": kv_put, "ceiling": fan(ceil_put_node), "twokey": twokey_put}
    gets = {"kvtier": kv_get, "ceiling": fan(ceil_get_node), "twokey": twokey_get}
    if sealed is not None:
        puts["kvtier+aes"] = lambda: sealed.write(srun, src)
        gets["kvtier+aes"] = lambda: sealed.read(srun, dst["kvtier+aes"].data)
    return puts, gets, dst, (tier, sealed)


def bench_target(
    t: Target, data: npt.NDArray[Any], chunk: int, repeat: int
) -> list[dict[str, Any]]:
    n = data.nbytes // chunk
    rng = np.random.default_rng(1)
    keys = [ChunkKey(rng.bytes(16)) for _ in range(n)]
    puts, gets, dst, tier = contenders(t, keys, data, chunk)
    put_cpu: dict[str, list[float]] = {}
    get_cpu: dict[str, list[float]] = {}
    try:
        put_s = interleaved(_cpu_timed(puts, put_cpu), repeat=repeat, warmup=1)
        get_s = interleaved(_cpu_timed(gets, get_cpu), repeat=repeat, warmup=1)
        for name, out in dst.items():
            if not np.array_equal(out, data):
                raise SystemExit(f"{t.name}/{name}: bytes read back differ from bytes written")
    finally:
        for one in tier:
            if one is not None:
                one.close()
        t.flush()
    ct = CHUNK_TOKENS[0]
    nbytes = data.nbytes
    return [
        _row(t.name, "put", put_s, nbytes, ct, put_cpu),
        _row(t.name, "get", get_s, nbytes, ct, get_cpu),
    ]


def _cpu_timed(fns: dict[str, Fn], cpu: dict[str, list[float]]) -> dict[str, Fn]:
    """``fns``, each also adding the CPU seconds it cost this process (every thread: the
    tier's and the baselines' worker threads) to ``cpu[name]``, warm-up runs included."""

    def timed(name: str, fn: Fn) -> Fn:
        def run() -> None:
            c0 = time.process_time()
            fn()
            cpu.setdefault(name, []).append(time.process_time() - c0)

        return run

    return {name: timed(name, fn) for name, fn in fns.items()}


def _row(
    target: str, op: str, s: dict[str, Sample], nbytes: int, ct: int, cpu: dict[str, list[float]]
) -> dict[str, Any]:
    gbps = {k: v.rate(nbytes) / 1e9 for k, v in s.items()}
    # Median client CPU of the timed runs (the first is the warm-up): on a loaded machine
    # far steadier than wall time. cpu_x_ceiling > 1: kvtier spends less CPU than raw
    # redis-py on the same bytes.
    cpu_s = {k: statistics.median(v[1:] or v) for k, v in cpu.items()}
    return {
        "target": target,
        "op": op,
        "chunk_tokens": ct,
        "kvtier_GBps": round(gbps["kvtier"], 3),
        "ceiling_GBps": round(gbps["ceiling"], 3),
        "twokey_GBps": round(gbps["twokey"], 3),
        "vs_ceiling": round(gbps["kvtier"] / gbps["ceiling"], 3),
        "vs_twokey": round(gbps["kvtier"] / gbps["twokey"], 3),
        **(
            {
                "kvtier_aes_GBps": round(gbps["kvtier+aes"], 3),
                "aes_vs_kvtier": round(gbps["kvtier+aes"] / gbps["kvtier"], 3),
            }
            if "kvtier+aes" in gbps
            else {}
        ),
        "seconds": {
            k: {"median": v.median_s, "min": v.min_s, "max": v.max_s, "runs": v.runs}
            for k, v in s.items()
        },
        "client_cpu_s": {k: round(v, 4) for k, v in cpu_s.items()},
        "cpu_x_ceiling": round(cpu_s["ceiling"] / cpu_s["kvtier"], 3),
    }


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="kvtier bench redis", description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen2-7b", help="KV geometry preset")
    ap.add_argument("--tp", type=int, default=4, help="tensor-parallel size; rank 0's shard")
    ap.add_argument("--tokens", type=int, default=32768)
    ap.add_argument(
        "--chunk-tokens",
        default="256",
        help="tokens per chunk; a comma list runs each (e.g. 256,16)",
    )
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--targets", default="single,cluster")
    ap.add_argument("--url", help="use this Redis instead of starting one")
    ap.add_argument("--cluster-nodes", help="use this cluster (host:port,...), start none")
    ap.add_argument("--batch-bytes", type=int, default=8 * MiB, help="bytes per round trip")
    ap.add_argument("--streams", type=int, default=2, help="tier connections per node")
    ap.add_argument("--json", dest="json_out")
    args = ap.parse_args(argv)
    # Every row needs redis-py: kvtier's redis tier and both raw baselines use it.
    if missing("redis", "every redis row", "pip install 'kvtier[redis]'"):
        return 0
    BATCH_BYTES[0] = args.batch_bytes
    STREAMS[0] = args.streams
    key_dir = tempfile.TemporaryDirectory(prefix="kvtier-bench-redis-key-")
    if not missing("cryptography", "the kvtier+aes columns", "pip install 'kvtier[crypto]'"):
        from kvtier.crypto import load_master_key

        KEY_FILE[0] = str(Path(key_dir.name) / "master_key")
        load_master_key(Path(KEY_FILE[0]), create=True)

    spec = replace(preset(args.model), tp_size=args.tp, tp_rank=0)
    data = np.random.default_rng(0).integers(
        0, 256, args.tokens * spec.bytes_per_token, dtype=np.uint8
    )
    sizes = [int(x) for x in str(args.chunk_tokens).split(",") if x]
    geometry = {
        "model": args.model,
        "tp_size": args.tp,
        "tp_rank": 0,
        "tokens": args.tokens,
        "bytes_per_token": spec.bytes_per_token,
        "total_bytes": data.nbytes,
        "chunk_tokens": sizes,
        "batch_bytes": args.batch_bytes,
        "streams_per_node": args.streams,
    }
    print(
        f"{args.model} TP{args.tp} rank 0: {args.tokens} tokens, {data.nbytes / MiB:.0f} MiB",
        file=sys.stderr,
    )

    from kvtier.bench.redis_procs import RedisClusterProcs, RedisServer

    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="kvtier-bench-redis-") as tmp:
        for target in [x for x in args.targets.split(",") if x]:
            procs: Any = None
            if target == "single":
                if args.url is None:
                    procs = RedisServer(Path(tmp) / "single").start()
                t = Target("single", args.url or procs.url, ())
            elif target == "cluster":
                if args.cluster_nodes is None:
                    procs = RedisClusterProcs(Path(tmp) / "cluster").start()
                    seeds = procs.seeds
                else:
                    seeds = tuple(args.cluster_nodes.split(","))
                t = Target("cluster-3", None, seeds)
            else:
                raise SystemExit(f"unknown target {target!r}: single or cluster")
            try:
                for ct in sizes:
                    CHUNK_TOKENS[0] = ct
                    chunk = spec.chunk_bytes(ct)
                    n = args.tokens // ct
                    rows.extend(bench_target(t, data[: n * chunk], chunk, args.repeat))
            finally:
                t.close()
                if procs is not None:
                    procs.stop()

    print(
        f"{'target':<10} {'chunk':>5} {'op':<4} {'kvtier':>8} {'ceiling':>8} {'twokey':>8} "
        f"{'x ceil':>7} {'x 2key':>7} {'cpu x ceil':>10}   (GB/s)"
    )
    for r in rows:
        aes = (
            f"   aes {r['kvtier_aes_GBps']:.3f} ({r['aes_vs_kvtier']:.3f}x)"
            if "aes_vs_kvtier" in r
            else ""
        )
        print(
            f"{r['target']:<10} {r['chunk_tokens']:>5} {r['op']:<4} {r['kvtier_GBps']:>8.3f} "
            f"{r['ceiling_GBps']:>8.3f} "
            f"{r['twokey_GBps']:>8.3f} {r['vs_ceiling']:>7.2f} {r['vs_twokey']:>7.2f} "
            f"{r['cpu_x_ceiling']:>10.2f}{aes}"
        )
    key_dir.cleanup()
    write_json(
        args.json_out,
        envelope("redis", rows, geometry=geometry, targets={"vs_ceiling": 0.8, "vs_twokey": 1.5}),
    )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
