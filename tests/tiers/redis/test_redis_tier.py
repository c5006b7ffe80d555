"""The redis tier against a real redis-server and a real 3-master cluster.

The contract suite (tests/contract) covers slot semantics; this module covers what is
particular to Redis: the value format, namespaces, TTL, probes, batching, corrupt
values, configuration, and the spread of a sequence over a cluster's masters.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import numpy as np
import pytest

from kvtier.config import load_config
from kvtier.errors import ConfigError, CorruptChunkError, TierIOError
from kvtier.keys import ChunkKey, Namespace
from kvtier.tiers.base import SlotRun, TierGeometry
from kvtier.tiers.redis import Options, RedisTier, wire
from tests.redis_servers import RedisClusterProcs, RedisServer

pytestmark = pytest.mark.redis
# The redis tier's extra; without it every test here is about a feature not installed.
pytest.importorskip("redis", reason="the redis tier needs redis-py: pip install 'kvtier[redis]'")

SLOT = 16 * 1024
NS = Namespace("llama-3-8b", "fp0", 256, "tenant-a")


def key(i: int) -> ChunkKey:
    return ChunkKey(i.to_bytes(16, "little"))


def rand(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, size=n, dtype=np.uint8)


@pytest.fixture
def make(redis_server: RedisServer) -> Iterator[object]:
    """Tiers on the session server, under a prefix no other test uses."""
    prefix = f"t-{uuid.uuid4().hex[:10]}"
    made: list[RedisTier] = []

    def build(ns: Namespace = NS, **opts: object) -> RedisTier:
        o = Options(url=redis_server.url, key_prefix=prefix, **opts)  # type: ignore[arg-type]
        t = RedisTier(TierGeometry("redis", 256 * SLOT, SLOT, 1 << 30), o, namespace=ns)
        made.append(t)
        return t

    yield build
    for t in made:
        t.close()


def put(
    tier: RedisTier, keys: list[ChunkKey], value_bytes: int = SLOT, seed: int = 0
) -> tuple[list[SlotRun], np.ndarray]:
    """Allocate and write ``keys`` (one run per extent); returns the runs and the bytes."""
    exts = tier.allocate(len(keys))
    assert exts is not None
    data = rand(len(keys) * value_bytes, seed)
    runs, pos = [], 0
    for e in exts:
        run = SlotRun(e.offset, tuple(keys[pos : pos + e.units]), value_bytes)
        tier.write(run, memoryview(data[pos * value_bytes : pos * value_bytes + run.nbytes]))
        runs.append(run)
        pos += e.units
    return runs, data


def read(tier: RedisTier, runs: list[SlotRun]) -> np.ndarray:
    parts = []
    for run in runs:
        out = np.zeros(run.nbytes, np.uint8)
        tier.read(run, memoryview(out))
        parts.append(out)
    return np.concatenate(parts)


def test_one_value_per_chunk_with_header(make, redis_server: RedisServer) -> None:
    tier = make()
    _, data = put(tier, [key(1), key(2)])
    r = redis_server.client()
    name = tier.redis_key(key(2))
    assert name.endswith(key(2).hex().encode())
    assert f":{NS.tenant}:{NS.spec_fingerprint}:".encode() in name
    value = r.get(name)
    assert len(value) == wire.HEADER_BYTES + SLOT
    assert value[:2] == wire.MAGIC and value[2] == wire.FORMAT_VERSION
    assert value[wire.HEADER_BYTES :] == data[SLOT:].tobytes()
    head = wire.parse_header(value, wire.namespace_id(NS.tenant, NS.spec_fingerprint))
    assert head.raw_len == SLOT and head.checksum == wire.checksum(key(2), data[SLOT:].tobytes())


def test_probe_reads_headers_and_stops_at_first_absent(make) -> None:
    tier = make()
    put(tier, [key(1), key(2), key(3)], value_bytes=1000)
    assert tier.probe([key(1), key(2), key(3)]) == (1000, 1000, 1000)
    assert tier.probe([key(1), key(9), key(3)]) == (1000,)
    assert tier.probe([key(9), key(1)]) == ()


def test_namespaces_never_collide(make) -> None:
    a = make()
    other_tenant = make(Namespace(NS.model, NS.spec_fingerprint, 256, "tenant-b"))
    other_spec = make(Namespace(NS.model, "fp1", 256, NS.tenant))
    put(a, [key(1)])
    assert a.probe([key(1)]) == (SLOT,)
    assert other_tenant.probe([key(1)]) == ()
    assert other_spec.probe([key(1)]) == ()


def test_value_of_another_namespace_is_corrupt_and_deleted(make, redis_server: RedisServer) -> None:
    a = make()
    b = make(Namespace(NS.model, NS.spec_fingerprint, 256, "tenant-b"))
    put(a, [key(1)])
    r = redis_server.client()
    r.set(b.redis_key(key(1)), r.get(a.redis_key(key(1))))  # a misplaced copy
    assert b.probe([key(1)]) == ()
    assert r.exists(b.redis_key(key(1))) == 0
    assert a.probe([key(1)]) == (SLOT,)


def test_value_under_another_key_fails_its_checksum(make, redis_server: RedisServer) -> None:
    tier = make()
    put(tier, [key(1)])
    r = redis_server.client()
    r.set(tier.redis_key(key(2)), r.get(tier.redis_key(key(1))))
    (e,) = tier.allocate(1)
    with pytest.raises(CorruptChunkError):
        tier.read(SlotRun(e.offset, (key(2),), SLOT), memoryview(np.zeros(SLOT, np.uint8)))
    assert r.exists(tier.redis_key(key(2))) == 0


def test_flipped_payload_byte_is_corrupt_and_deleted(make, redis_server: RedisServer) -> None:
    tier = make()
    runs, _ = put(tier, [key(1), key(2), key(3), key(4)])
    r = redis_server.client()
    name = tier.redis_key(key(2))
    byte = r.getrange(name, 100, 100)
    r.setrange(name, 100, bytes([byte[0] ^ 0xFF]))
    with pytest.raises(CorruptChunkError):
        read(tier, runs)
    assert r.exists(name) == 0
    assert r.exists(tier.redis_key(key(1))) == 1  # the good neighbours stay


def test_a_value_far_longer_than_a_chunk_is_corrupt_and_deleted(
    make, redis_server: RedisServer
) -> None:
    # More than a chunk and the reader's slack: read off the socket, never buffered whole.
    tier = make()
    runs, _ = put(tier, [key(1), key(2)])
    r = redis_server.client()
    name = tier.redis_key(key(2))
    r.set(name, r.get(name) + bytes(3 << 20))
    with pytest.raises(CorruptChunkError):
        read(tier, runs)
    assert r.exists(name) == 0
    again, _ = put(tier, [key(2)], seed=1)  # the connection still serves: heal and read
    assert read(tier, again).tobytes() == rand(SLOT, 1).tobytes()


def test_garbage_header_is_absent_and_deleted(make, redis_server: RedisServer) -> None:
    tier = make()
    r = redis_server.client()
    r.set(tier.redis_key(key(5)), b"not a kvtier value at all, but long enough")
    assert tier.probe([key(5)]) == ()
    assert r.exists(tier.redis_key(key(5))) == 0


def test_truncated_value_is_corrupt(make, redis_server: RedisServer) -> None:
    tier = make()
    runs, _ = put(tier, [key(1)])
    r = redis_server.client()
    name = tier.redis_key(key(1))
    r.set(name, r.get(name)[:-10])
    with pytest.raises(CorruptChunkError):
        read(tier, runs)


def test_missing_value_is_an_io_error(make, redis_server: RedisServer) -> None:
    tier = make()
    runs, _ = put(tier, [key(1), key(2)])
    redis_server.client().delete(tier.redis_key(key(2)))  # as if Redis evicted it
    with pytest.raises(TierIOError):
        read(tier, runs)


def test_ttl_is_set_on_write(make, redis_server: RedisServer) -> None:
    tier = make(ttl_s=600.0)
    put(tier, [key(1)])
    pttl = redis_server.client().pttl(tier.redis_key(key(1)))
    assert 0 < pttl <= 600_000
    plain = make()
    put(plain, [key(2)])
    assert redis_server.client().pttl(plain.redis_key(key(2))) == -1  # no expiry


def test_a_read_slides_the_ttl(make, redis_server: RedisServer) -> None:
    tier = make(ttl_s=600.0)
    runs, data = put(tier, [key(1), key(2)])
    r = redis_server.client()
    for k in (key(1), key(2)):
        r.pexpire(tier.redis_key(k), 5_000)
    assert np.array_equal(read(tier, runs), data)
    assert all(r.pttl(tier.redis_key(k)) > 500_000 for k in (key(1), key(2)))


def test_an_error_reply_fails_the_read_and_the_next_read_is_whole(
    make, redis_server: RedisServer
) -> None:
    # A key of another type answers GET with an error: that chunk fails, the batch's
    # other replies are still read, and the connection serves the next read correctly.
    tier = make()
    keys = [key(i) for i in range(6)]
    runs, data = put(tier, keys)
    r = redis_server.client()
    bad = tier.redis_key(keys[2])
    r.delete(bad)
    r.rpush(bad, b"x")
    with pytest.raises(TierIOError, match="WRONGTYPE"):
        read(tier, runs)
    r.delete(bad)
    (fixed,) = tier.allocate(1)
    tier.write(SlotRun(fixed.offset, (keys[2],), SLOT), memoryview(data[2 * SLOT : 3 * SLOT]))
    for _ in range(3):
        assert np.array_equal(read(tier, runs), data)


def test_reads_of_values_shorter_than_a_slot_and_of_many_batches_round_trip(make) -> None:
    # Values of an odd size, in batches of two (a reply's line and value cut across
    # socket reads at every offset), read again and again on the same connections.
    tier = make(batch_bytes=2 * (1001 + wire.HEADER_BYTES))
    keys = [key(i) for i in range(40)]
    runs, data = put(tier, keys, value_bytes=1001)
    for _ in range(3):
        assert np.array_equal(read(tier, runs), data)


def bf16_like(n_bytes: int, seed: int = 0) -> np.ndarray:
    """bf16 values of a smooth distribution (compressible high bytes, noisy low bytes)."""
    f = np.random.default_rng(seed).normal(0, 1, n_bytes // 2).astype(np.float32)
    return (f.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8)


def test_lz4_codec_shrinks_kv_and_round_trips(make, redis_server: RedisServer) -> None:
    tier = make(codec="lz4-shuffle")
    keys = [key(1), key(2)]
    (e,) = tier.allocate(2)
    run = SlotRun(e.offset, tuple(keys), SLOT)
    data = np.concatenate([bf16_like(SLOT, 1), rand(SLOT, 2)])  # KV-like, then noise
    tier.write(run, memoryview(data))
    r = redis_server.client()
    kv_value, noise_value = (r.get(tier.redis_key(k)) for k in keys)
    assert kv_value[3] != wire.CODEC_RAW and len(kv_value) < wire.HEADER_BYTES + SLOT
    assert noise_value[3] == wire.CODEC_RAW  # incompressible: stored raw
    out = np.zeros_like(data)
    tier.read(run, memoryview(out))
    assert np.array_equal(out, data)
    plain = make()  # a reader without the codec setting decodes it too (the header says)
    assert plain.probe(keys) == (SLOT, SLOT)
    r.setrange(tier.redis_key(key(1)), wire.HEADER_BYTES + 50, b"\xff\xff\xff\xff")
    with pytest.raises(CorruptChunkError):
        tier.read(run, memoryview(out))


def test_a_value_encoded_with_lz4_read_without_lz4_is_a_miss_and_stays(
    make, redis_server: RedisServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A reader installed without the nvme extra, sharing Redis with one that has it:
    # the encoded value is a TierIOError (a miss), not ModuleNotFoundError, and it is
    # not deleted as corrupt (it is good for readers that have lz4).
    pytest.importorskip("lz4", reason="writing the value needs lz4: pip install 'kvtier[nvme]'")
    import sys

    writer = make(codec="lz4-shuffle")
    (e,) = writer.allocate(1)
    run = SlotRun(e.offset, (key(7),), SLOT)
    data = bf16_like(SLOT, 7)
    writer.write(run, memoryview(data))
    stored = redis_server.client().get(writer.redis_key(key(7)))
    assert stored[3] != wire.CODEC_RAW
    reader = make()  # codec "none": starts without lz4
    monkeypatch.setitem(sys.modules, "lz4", None)
    monkeypatch.setitem(sys.modules, "lz4.block", None)
    out = np.zeros_like(data)
    with pytest.raises(TierIOError, match="lz4"):
        reader.read(run, memoryview(out))
    assert redis_server.client().get(writer.redis_key(key(7))) == stored
    monkeypatch.undo()
    reader.read(run, memoryview(out))
    assert np.array_equal(out, data)


def test_batches_bounded_by_bytes_still_round_trip(make) -> None:
    tier = make(batch_bytes=3 * SLOT)  # three values per round trip at most
    runs, data = put(tier, [key(i) for i in range(20)], seed=9)
    assert np.array_equal(read(tier, runs), data)


def test_discard_deletes_and_counts(make) -> None:
    tier = make()
    put(tier, [key(1), key(2)])
    assert tier.discard([key(1), key(2), key(3)]) == 2
    assert tier.probe([key(1)]) == ()


def test_unreachable_server_is_a_miss_not_an_exception() -> None:
    from tests.redis_servers import free_port

    tier = RedisTier(
        TierGeometry("redis", 16 * SLOT, SLOT, 1 << 30),
        Options(url=f"redis://127.0.0.1:{free_port()}/0", op_budget_s=0.5, connect_timeout_s=0.2),
    )
    try:
        assert tier.probe([key(1)]) == ()
        (e,) = tier.allocate(1)
        with pytest.raises(TierIOError):
            tier.write(SlotRun(e.offset, (key(1),), SLOT), memoryview(rand(SLOT)))
        (h,) = tier.health()
        assert not h.up and h.failures >= 1 and h.last_error
    finally:
        tier.close()


def test_config_section_builds_a_redis_tier() -> None:
    cfg = load_config(
        env={"KVTIER_TIERS__1__CLUSTER_NODES": "10.0.0.1:7000,10.0.0.2:7000"},
        base={
            "tiers": [
                {"kind": "host", "capacity_bytes": "64MiB"},
                {
                    "kind": "redis",
                    "capacity_bytes": "1TiB",
                    "ttl_s": "3600",
                    "batch_bytes": "16MiB",
                },
            ]
        },
    )
    opts = cfg.tiers[1].options
    assert isinstance(opts, Options)
    assert opts.ttl_s == 3600.0 and opts.batch_bytes == 16 << 20
    assert opts.cluster_nodes == ("10.0.0.1:7000", "10.0.0.2:7000")


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("ttl_s", -1.0),
        ("op_budget_s", 0.0),
        ("batch_bytes", 0),
        ("backoff_max_s", 0.01),
        ("key_prefix", ""),
    ],
)
def test_bad_options_fail_loudly(field: str, value: object) -> None:
    with pytest.raises(ConfigError, match=field):
        Options(**{field: value})  # type: ignore[arg-type]


def test_bad_url_and_seeds_fail_loudly() -> None:
    with pytest.raises(ConfigError):
        RedisTier(TierGeometry("r", 16 * SLOT, SLOT, 1 << 30), Options(url="http://nope"))
    with pytest.raises(ConfigError):
        RedisTier(TierGeometry("r", 16 * SLOT, SLOT, 1 << 30), Options(cluster_nodes=("no-port",)))


def test_cluster_spreads_a_sequence_over_every_master(redis_cluster: RedisClusterProcs) -> None:
    tier = RedisTier(
        TierGeometry("rc", 256 * SLOT, SLOT, 1 << 30),
        Options(cluster_nodes=redis_cluster.seeds, key_prefix=f"t-{uuid.uuid4().hex[:10]}"),
        namespace=NS,
    )
    try:
        keys = [key(i) for i in range(48)]
        runs, data = put(tier, keys)
        owners = {redis_cluster.owner_of(tier.redis_key(k)).port for k in keys}
        assert owners == {s.port for s in redis_cluster.servers}
        assert np.array_equal(read(tier, runs), data)
        assert tier.probe(keys) == (SLOT,) * 48
        assert {h.node for h in tier.health()} == set(redis_cluster.seeds)
    finally:
        tier.close()
