"""The shared Redis tier with real servers: two processes, and the faults of issue 7.

Two plain Python processes stand in for two machines: each builds its own store from a
config through ``build_store`` (own host tier, the same Redis, tenant "acme").
``test_redis_daemons.py`` does the same with two ``kvtier serve`` daemons.
Fault tests own their servers (``fresh_redis``, ``fresh_cluster``) so stopping, filling
or killing one never disturbs another test. No test here measures time: a budget shows
as a miss where waiting would have been a hit.
"""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from kvtier.keys import ChunkKey
from kvtier.store import TieredStore
from kvtier.tiers.base import TierGeometry
from kvtier.tiers.redis import Options, RedisTier
from tests.redis_servers import RedisClusterProcs, RedisServer

pytestmark = pytest.mark.redis

ROOT = Path(__file__).resolve().parents[2]
SLOT = 64 * 1024


def key(i: int) -> ChunkKey:
    return ChunkKey(i.to_bytes(16, "little"))


def rand(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, size=n, dtype=np.uint8)


def redis_store(prefix: str, cap_slots: int = 512, **opts: object) -> TieredStore:
    """A store whose only tier is Redis, with a short budget and quick reconnects."""
    o = {"op_budget_s": 1.0, "connect_timeout_s": 0.2, "backoff_min_s": 0.02, "backoff_max_s": 0.2}
    o.update(opts)
    options = Options(key_prefix=prefix, **o)  # type: ignore[arg-type]
    tier = RedisTier(TierGeometry("redis", cap_slots * SLOT, SLOT, 1 << 30), options)
    return TieredStore([tier], io_threads=2, promote_on_hit=False)


def eventually(cond: Callable[[], bool], what: str, tries: int = 300) -> None:
    """Poll ``cond`` (reconnects are backed off); fail with ``what`` if it never holds."""
    for _ in range(tries):
        if cond():
            return
        time.sleep(0.05)
    pytest.fail(f"never happened: {what}")


# -- two processes ---------------------------------------------------------------------------


def test_chunk_stored_by_one_process_is_a_hit_in_another(redis_server: RedisServer) -> None:
    prefix = f"xp-{uuid.uuid4().hex[:10]}"
    cmd = [sys.executable, "-m", "tests.integration.redis_peer"]
    args = ["--url", redis_server.url, "--prefix", prefix, "--seed", "7"]
    writer = subprocess.Popen(
        [*cmd, "put", *args], cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert writer.stdout is not None and writer.stdin is not None
        put = json.loads(writer.stdout.readline())
        assert put["stored"] == 8 and put["redis_bytes"] > 0
        # The writer is still running with the chunks in its own store; the reader is
        # another process with its own (empty) host tier.
        got = subprocess.run(
            [*cmd, "get", *args], cwd=ROOT, capture_output=True, text=True, timeout=120, check=True
        )
        read = json.loads(got.stdout)
        assert read["hits"] == 8 and read["tiers"] == ["redis"] and read["chunks"] == 8
        assert read["sha256"] == put["sha256"]
    finally:
        if writer.stdin:
            writer.stdin.close()
        writer.wait(60)
    assert writer.returncode == 0


# -- faults on a single server ---------------------------------------------------------------


def test_redis_stopped_mid_run_then_restarted(
    fresh_redis: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING)
    keys = [key(i) for i in range(12)]
    data = rand(12 * SLOT, 1)
    with redis_store("f", url=fresh_redis.url) as store:
        assert store.put(keys[:4], data[: 4 * SLOT]).result().stored == 4
        fresh_redis.stop()
        out = np.zeros_like(data)
        assert store.get(keys[:4], out).result().chunks == 0  # a miss, not an exception
        res = store.put(keys[4:8], data[4 * SLOT : 8 * SLOT]).result()
        assert res.stored == 0 and res.failed + res.rejected == 4
        assert store.lookup(keys[4:]).hits == 0
        assert store.stats().tier_errors >= 1
        (health,) = store.tiers[0].health()  # type: ignore[attr-defined]
        assert not health.up and health.last_error
        assert any("unavailable" in r.getMessage() for r in caplog.records)

        fresh_redis.start()  # same port, empty (no persistence)
        eventually(
            lambda: store.put(keys[8:], data[8 * SLOT :]).result().stored == 4,
            "a put succeeds after the restart",
        )
        out = np.zeros(4 * SLOT, np.uint8)
        assert store.get(keys[8:], out).result().chunks == 4
        assert np.array_equal(out, data[8 * SLOT :])
        assert store.lookup(keys[:4]).hits == 0  # lost with the restart, never stale
        assert any("reachable again" in r.getMessage() for r in caplog.records)


def test_slow_redis_is_a_miss_within_the_budget(fresh_redis: RedisServer) -> None:
    keys = [key(i) for i in range(4)]
    data = rand(4 * SLOT, 2)
    with redis_store("s", url=fresh_redis.url) as writer:
        writer.put(keys, data).result()
    raw = fresh_redis.client()
    sleeper = threading.Thread(target=raw.execute_command, args=("DEBUG", "SLEEP", "3"))
    sleeper.start()
    try:
        import redis
        from redis.backoff import NoBackoff
        from redis.retry import Retry

        probe = redis.Redis(
            host="127.0.0.1",
            port=fresh_redis.port,
            socket_timeout=0.05,
            retry=Retry(NoBackoff(), 0),
        )

        def blocked() -> bool:
            try:
                probe.ping()
            except Exception:
                return True
            return False

        eventually(blocked, "redis-server blocked by DEBUG SLEEP")
        with redis_store("s", url=fresh_redis.url, op_budget_s=0.3) as reader:
            # Waiting out the sleep would have found all four chunks.
            assert reader.lookup(keys).hits == 0
            out = np.zeros_like(data)
            assert reader.get(keys, out).result().chunks == 0
    finally:
        sleeper.join()
    with redis_store("s", url=fresh_redis.url) as reader:
        assert reader.lookup(keys).hits == 4


def test_maxmemory_with_allkeys_lru_evicts_into_misses(fresh_redis: RedisServer) -> None:
    raw = fresh_redis.client()
    raw.config_set("maxmemory", "4mb")
    raw.config_set("maxmemory-policy", "allkeys-lru")
    n = 128  # 8 MiB of values into 4 MiB
    keys = [key(i) for i in range(n)]
    data = rand(n * SLOT, 3)
    with redis_store("m", url=fresh_redis.url) as writer:
        for i in range(0, n, 16):
            res = writer.put(keys[i : i + 16], data[i * SLOT : (i + 16) * SLOT]).result()
            assert res.stored == 16  # Redis evicts instead of refusing writes
        hits = misses = 0
        with redis_store("m", url=fresh_redis.url) as reader:
            for i, k in enumerate(keys):
                out = np.zeros(SLOT, np.uint8)
                got = reader.get([k], out).result().chunks
                if got:
                    assert np.array_equal(out, data[i * SLOT : (i + 1) * SLOT])
                    hits += 1
                else:
                    misses += 1
        assert hits > 0 and misses > 0
        # The writer's index still lists every chunk; what Redis evicted reads as a miss.
        out = np.zeros_like(data)
        got = writer.get(keys, out).result()
        assert got.chunks < n
        assert np.array_equal(out[: got.nbytes], data[: got.nbytes])


def test_corrupt_value_is_a_miss_deleted_and_healed(fresh_redis: RedisServer) -> None:
    keys = [key(i) for i in range(8)]
    data = rand(8 * SLOT, 4)
    with redis_store("c", url=fresh_redis.url) as writer:
        writer.put(keys, data).result()
        tier = writer.tiers[0]
        assert isinstance(tier, RedisTier)
        name = tier.redis_key(keys[5])
    raw = fresh_redis.client()
    raw.setrange(name, 1000, b"\x00\x01\x02\x03")  # bit rot inside the payload
    with redis_store("c", url=fresh_redis.url) as reader:
        assert reader.lookup(keys).hits == 8  # headers are intact
        out = np.zeros_like(data)
        got = reader.get(keys, out).result()
        assert got.chunks < 6
        assert np.array_equal(out[: got.nbytes], data[: got.nbytes])
        assert reader.stats().corrupt_chunks >= 1
        assert raw.exists(name) == 0
        assert reader.put(keys, data).result().stored >= 1  # the next put heals it
    with redis_store("c", url=fresh_redis.url) as third:
        out = np.zeros_like(data)
        assert third.get(keys, out).result().chunks == 8
        assert np.array_equal(out, data)


# -- the cluster -------------------------------------------------------------------------------


def test_cluster_keeps_serving_other_slots_when_a_master_dies(
    fresh_cluster: RedisClusterProcs,
) -> None:
    n = 48
    keys = [key(i) for i in range(n)]
    data = rand(n * SLOT, 5)
    seeds = fresh_cluster.seeds
    with redis_store("k", cluster_nodes=seeds) as writer:
        assert writer.put(keys, data).result().stored == n
        tier = writer.tiers[0]
        assert isinstance(tier, RedisTier)
        owners = [fresh_cluster.owner_of(tier.redis_key(k)).port for k in keys]
    victim = fresh_cluster.servers[1]
    assert victim.port in owners
    victim.kill()
    with redis_store("k", cluster_nodes=seeds) as reader:
        for i, k in enumerate(keys):
            alive = owners[i] != victim.port
            out = np.zeros(SLOT, np.uint8)
            got = reader.get([k], out).result().chunks
            assert got == int(alive), f"chunk {i} on {owners[i]}"
            if alive:
                assert np.array_equal(out, data[i * SLOT : (i + 1) * SLOT])
        # New chunks are stored where their slot's master is alive, and only there.
        for i in range(16):
            k = key(1000 + i)
            alive = fresh_cluster.owner_of(tier.redis_key(k)).port != victim.port
            res = reader.put([k], rand(SLOT, 100 + i)).result()
            assert (res.stored, res.failed) == ((1, 0) if alive else (0, 1))
