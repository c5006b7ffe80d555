"""The store over *shared* tiers: chunks another process stored are found and adopted.

Two kinds of shared medium: a small dict-backed tier defined here (the store knows no
tier by name, so any :class:`SharedTier` behaves alike; runs without Redis), and the
real ``redis`` tier on a real redis-server (two stores stand in for two processes;
tests/integration has the cross-process version).
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator, Sequence

import numpy as np
import pytest
from typing_extensions import override

from kvtier.config import Switch
from kvtier.keys import ChunkKey, Namespace
from kvtier.store import TieredStore
from kvtier.tiers.base import SharedTier, SlotRun, TierGeometry
from kvtier.tiers.host import HostTier
from kvtier.tiers.host import Options as HostOptions
from tests.redis_servers import RedisServer

SLOT = 8192


def key(i: int) -> ChunkKey:
    return ChunkKey(i.to_bytes(16, "little"))


def rand(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, size=n, dtype=np.uint8)


class DictShared(SharedTier):
    """A shared medium in a dict that several tier instances (stores) see."""

    kind = "dict-shared"

    def __init__(self, medium: dict[bytes, bytes], capacity_slots: int) -> None:
        super().__init__(TierGeometry("shared", capacity_slots * SLOT, SLOT, 1 << 30))
        self.medium = medium

    @override
    def _write(self, run: SlotRun, src: memoryview) -> None:
        for j, k in enumerate(run.keys):
            self.medium[k] = bytes(src[j * run.value_bytes : (j + 1) * run.value_bytes])

    @override
    def _read(self, run: SlotRun, dst: memoryview) -> None:
        from kvtier.errors import TierIOError

        for j, k in enumerate(run.keys):
            v = self.medium.get(k)
            if v is None or len(v) != run.value_bytes:
                raise TierIOError(f"{k.hex()} gone")
            dst[j * run.value_bytes : (j + 1) * run.value_bytes] = v

    @override
    def bind(self, namespace: Namespace) -> None:
        pass  # one test, one namespace

    @override
    def probe(self, keys: Sequence[ChunkKey]) -> tuple[int, ...]:
        out = []
        for k in keys:
            if k not in self.medium:
                break
            out.append(len(self.medium[k]))
        return tuple(out)

    @override
    def discard(self, keys: Sequence[ChunkKey]) -> int:
        return sum(self.medium.pop(k, None) is not None for k in keys)


def host(slots: int) -> HostTier:
    return HostTier(TierGeometry("host", slots * SLOT, SLOT, 1 << 30), HostOptions(pin=Switch.OFF))


def test_lookup_adopts_what_another_store_wrote() -> None:
    medium: dict[bytes, bytes] = {}
    keys = [key(i) for i in range(12)]
    data = rand(12 * SLOT, 1)
    with TieredStore([DictShared(medium, 64)]) as a:
        assert a.put(keys[:8], data[: 8 * SLOT]).result().stored == 8
    with TieredStore([host(4), DictShared(medium, 64)], promote_on_hit=False) as b:
        r = b.lookup(keys)
        assert r.hits == 8 and set(r.tiers) == {"shared"}
        assert r.value_bytes == (SLOT,) * 8
        assert b.stats().adopted_chunks == 8
        out = np.zeros_like(data)
        g = b.get(keys, out).result()
        assert g.chunks == 8 and np.array_equal(out[: 8 * SLOT], data[: 8 * SLOT])
        assert b.lookup(keys).hits == 8 and b.stats().adopted_chunks == 8  # once is enough


def test_get_without_lookup_adopts_on_the_io_thread() -> None:
    medium: dict[bytes, bytes] = {}
    keys = [key(i) for i in range(6)]
    data = rand(6 * SLOT, 2)
    with TieredStore([DictShared(medium, 64)]) as a:
        a.put(keys, data).result()
    with TieredStore([host(16), DictShared(medium, 64)]) as b:
        b.put(keys[:2], data[: 2 * SLOT]).result()  # the head is local, the tail shared
        out = np.zeros_like(data)
        g = b.get(keys, out).result()
        assert g.chunks == 6 and np.array_equal(out, data)
        assert g.tiers[:2] == ("host", "host") and set(g.tiers[2:]) <= {"shared", "host"}


def test_get_adopts_no_more_than_the_destination_holds() -> None:
    medium: dict[bytes, bytes] = {}
    keys = [key(i) for i in range(6)]
    data = rand(6 * SLOT, 3)
    with TieredStore([DictShared(medium, 64)]) as a:
        a.put(keys, data).result()
    with TieredStore([DictShared(medium, 64)]) as b:
        out = np.zeros(3 * SLOT, np.uint8)
        g = b.get(keys, out).result()
        assert g.chunks == 3 and np.array_equal(out, data[: 3 * SLOT])


def test_adoption_is_bounded_by_the_tiers_logical_capacity() -> None:
    medium: dict[bytes, bytes] = {}
    keys = [key(i) for i in range(10)]
    data = rand(10 * SLOT, 4)
    with TieredStore([DictShared(medium, 64)]) as a:
        a.put(keys, data).result()
    with TieredStore([DictShared(medium, 4)]) as b:
        assert b.lookup(keys).hits == 4
        assert b.stats().chunks == 4
        # Evicting from the logical index leaves the shared value for the others.
        assert b.lookup(keys[6:]).hits == 4
        assert len(medium) == 10


def test_delete_removes_from_the_shared_medium() -> None:
    medium: dict[bytes, bytes] = {}
    keys = [key(i) for i in range(6)]
    with TieredStore([DictShared(medium, 64)]) as a:
        a.put(keys, rand(6 * SLOT)).result()
        with TieredStore([DictShared(medium, 64)]) as b:
            assert b.lookup(keys[:2]).hits == 2
            assert b.delete(keys[:4]) == 4  # two indexed here, two only in the medium
            assert b.lookup(keys).hits == 0
        out = np.zeros(6 * SLOT, np.uint8)
        assert a.get(keys, out).result().chunks == 0  # never stale bytes
        assert a.lookup(keys[4:]).hits == 2


def test_promotion_keeps_the_shared_copy() -> None:
    medium: dict[bytes, bytes] = {}
    keys = [key(i) for i in range(4)]
    data = rand(4 * SLOT, 5)
    with TieredStore([DictShared(medium, 64)]) as a:
        a.put(keys, data).result()
    with TieredStore([host(8), DictShared(medium, 64)]) as b:
        b.get(keys, np.zeros_like(data)).result()
        b.flush()  # promotion runs in the background
        assert b.stats().promoted_chunks == 4
        assert len(medium) == 4


# -- over a real redis-server --------------------------------------------------------------


@pytest.fixture
def redis_pair(redis_server: RedisServer) -> Iterator[tuple[TieredStore, TieredStore]]:
    """Two stores, each with its own host tier, over one Redis (same namespace)."""
    from kvtier.tiers.redis import Options, RedisTier

    prefix = f"s-{uuid.uuid4().hex[:10]}"

    def store() -> TieredStore:
        opts = Options(url=redis_server.url, key_prefix=prefix)
        r = RedisTier(TierGeometry("redis", 1024 * SLOT, SLOT, 1 << 30), opts)
        return TieredStore([host(8), r], promote_on_hit=False)

    a, b = store(), store()
    yield a, b
    a.close()
    b.close()


@pytest.mark.redis
def test_redis_chunk_stored_by_one_store_is_a_hit_in_the_other(redis_pair) -> None:
    a, b = redis_pair
    keys = [key(100 + i) for i in range(24)]
    data = rand(24 * SLOT, 6)
    # 24 chunks through a host tier of 8: the first 16 are demoted into Redis.
    for i in range(0, 24, 8):
        a.put(keys[i : i + 8], data[i * SLOT : (i + 8) * SLOT]).result()
    assert set(a.lookup(keys).tiers) == {"host", "redis"}
    r = b.lookup(keys)
    assert r.hits == 16 and set(r.tiers) == {"redis"}
    out = np.zeros(16 * SLOT, np.uint8)
    g = b.get(keys, out).result()
    assert g.chunks == 16 and np.array_equal(out, data[: 16 * SLOT])
