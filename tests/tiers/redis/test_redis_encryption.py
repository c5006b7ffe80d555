"""Encryption of redis values against a real server: sealed in Redis, read back, and a
flipped byte or a value copied under another tenant's key is a miss, never bytes."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("cryptography", reason="encryption needs: pip install 'kvtier[crypto]'")
pytest.importorskip("redis", reason="the redis tier needs redis-py: pip install 'kvtier[redis]'")

from kvtier.crypto import OVERHEAD, load_master_key
from kvtier.errors import CorruptChunkError, TierIOError
from kvtier.keys import tag_key
from kvtier.store.quota import tenant_tag
from kvtier.tiers.base import SlotRun
from kvtier.tiers.redis import wire
from tests.redis_servers import RedisServer
from tests.tiers.redis import test_redis_tier as base
from tests.tiers.redis.test_redis_tier import SLOT, put, read

make = base.make  # the fixture: tiers on the session server, under a fresh prefix


def tkey(tenant: str, i: int) -> bytes:
    return tag_key(bytes(4) + i.to_bytes(12, "little"), tenant_tag(tenant))


@pytest.fixture
def key_file(tmp_path: Path) -> str:
    path = tmp_path / "master_key"
    load_master_key(path, create=True)
    return str(path)


def test_values_are_sealed_in_redis_and_read_back(
    make: Any, redis_server: RedisServer, key_file: str
) -> None:
    tier = make(encryption_key_file=key_file)
    keys = [tkey("alice", i) for i in range(4)]
    runs, data = put(tier, keys)  # type: ignore[arg-type]
    assert np.array_equal(read(tier, runs), data)
    stored = redis_server.client().get(tier.redis_key(keys[0]))
    assert len(stored) == wire.HEADER_BYTES + SLOT + OVERHEAD
    assert data[100:164].tobytes() not in stored
    assert np.array_equal(read(make(encryption_key_file=key_file), runs), data)  # another process


def test_a_flipped_byte_is_a_miss(make: Any, redis_server: RedisServer, key_file: str) -> None:
    tier = make(encryption_key_file=key_file)
    runs, _ = put(tier, [tkey("alice", 7)])  # type: ignore[arg-type]
    r = redis_server.client()
    name = tier.redis_key(tkey("alice", 7))  # type: ignore[arg-type]
    value = bytearray(r.get(name))
    value[wire.HEADER_BYTES + 100] ^= 0x01
    r.set(name, bytes(value))
    with pytest.raises(CorruptChunkError):
        read(tier, runs)


def test_another_tenants_value_copied_under_its_key_is_a_miss(
    make: Any, redis_server: RedisServer, key_file: str
) -> None:
    tier = make(encryption_key_file=key_file)
    alice, bob = tkey("alice", 1), tkey("bob", 1)
    put(tier, [alice])  # type: ignore[arg-type]
    runs, _ = put(tier, [bob], seed=1)  # type: ignore[arg-type]
    r = redis_server.client()
    # Bob's value replaced by alice's, header and all: the keyed checksum would not stop a
    # forger who recomputes it, the tag does (another tenant's key, another chunk key).
    r.set(tier.redis_key(bob), r.get(tier.redis_key(alice)))  # type: ignore[arg-type]
    with pytest.raises(CorruptChunkError):
        read(tier, runs)
    assert runs == [SlotRun(runs[0].offset, (bob,), SLOT)]


def test_a_value_in_clear_is_refused_when_encryption_is_on(
    make: Any, redis_server: RedisServer, key_file: str
) -> None:
    clear = make()
    k = tkey("alice", 3)
    runs, _ = put(clear, [k])  # type: ignore[arg-type]
    sealed = make(encryption_key_file=key_file)
    assert sealed.probe([k]) == ()  # sealed values live under names of their own
    r = redis_server.client()
    r.set(sealed.redis_key(k), r.get(clear.redis_key(k)))  # a value in clear put there
    with pytest.raises(CorruptChunkError):
        read(sealed, runs)


def test_a_tier_under_another_master_key_never_sees_nor_deletes_the_values(
    make: Any, redis_server: RedisServer, key_file: str, tmp_path: Path
) -> None:
    other_key = tmp_path / "other_key"
    load_master_key(other_key, create=True)
    mine, theirs = make(encryption_key_file=key_file), make(encryption_key_file=str(other_key))
    keys = [tkey("alice", i) for i in range(3)]
    runs, data = put(mine, keys)  # type: ignore[arg-type]
    assert theirs.probe(keys) == ()  # absent for it, not corrupt
    with pytest.raises(TierIOError):
        read(theirs, runs)
    assert np.array_equal(read(mine, runs), data)
    assert all(redis_server.client().exists(mine.redis_key(k)) for k in keys)
