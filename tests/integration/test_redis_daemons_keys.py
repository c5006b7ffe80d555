"""Two daemons with different master keys over one Redis: neither destroys the other's data.

A peer given the wrong key file (or a key rotated on one daemon only) cannot open the
values the other sealed. It must treat them as absent, not as corrupt: a reader that
deleted every value failing its tag would wipe the shared cache. Both daemons are real
``kvtier serve`` processes over a real ``redis-server``, sharing the key salt (so a client
key names the same chunk in both), each with its own master key file. Last, the tenants of
one daemon: one who knows another's client keys and can write to Redis still opens none of
the other's values.
"""

from __future__ import annotations

import signal
import uuid
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from kvtier.crypto import load_master_key
from tests.integration.test_redis_daemons import CHUNK, Daemon, daemon_pair, write_config
from tests.redis_servers import RedisServer

pytestmark = pytest.mark.redis
PREFIX = f"keys-{uuid.uuid4().hex[:8]}"  # this module's Redis keys, apart from other tests'
pytest.importorskip("cryptography", reason="encryption needs: pip install 'kvtier[crypto]'")
pytest.importorskip("httpx")


def sealed_config(tmp: Path, name: str, redis_url: str, prefix: str) -> Path:
    """The two-daemon configuration with encryption under a master key of its own."""
    key_file = tmp / f"master_key_{name}"
    load_master_key(key_file, create=True)
    path = write_config(tmp / f"kvtier-{name}.toml", redis_url, prefix)
    path.write_text(path.read_text() + f'\n[encryption]\nenabled = true\nkey_file = "{key_file}"\n')
    return path


@pytest.fixture
def keyed_daemons(tmp_path: Path, redis_server: RedisServer) -> Iterator[tuple[Daemon, Daemon]]:
    """Daemons a and b, each with its own master key; their Redis keys start with PREFIX."""
    configs = [sealed_config(tmp_path, n, redis_server.url, PREFIX) for n in ("a", "b")]
    with daemon_pair(tmp_path, *configs) as pair:
        yield pair


def _corrupt(c: object) -> int:
    stats = c.stats()["store"]  # type: ignore[attr-defined]
    return int(stats["corrupt_chunks"])


def test_a_peer_with_another_key_misses_and_leaves_the_values_intact(
    keyed_daemons: tuple[Daemon, Daemon], redis_server: RedisServer
) -> None:
    from kvtier.service.client import Client

    a, b = keyed_daemons
    rng = np.random.default_rng(5)
    keys = [rng.bytes(16).hex() for _ in range(8)]
    values = [rng.bytes(CHUNK) for _ in keys]
    r = redis_server.client()
    with Client(a.url) as ca, Client(b.url) as cb:
        for k, v in zip(keys, values, strict=True):
            assert ca.put(k, v).stored == 1  # older ones go down to Redis, sealed
        assert set(ca.lookup(keys).tiers) == {"host", "redis"}
        names_before = set(r.scan_iter(match=f"{PREFIX}:*", count=1000))
        assert names_before  # A's sealed values are in Redis

        # B, with another key: every key a miss, nothing counted corrupt, nothing deleted.
        assert cb.lookup(keys).hits == 0
        assert all(cb.get(k) is None for k in keys)
        assert _corrupt(cb) == 0
        assert names_before <= set(r.scan_iter(match=f"{PREFIX}:*", count=1000))

        # B stores the same client keys under its own key: A's values are untouched.
        for k, v in zip(keys, values, strict=True):
            assert cb.put(k, v[::-1]).stored == 1
        for k, v in zip(keys, values, strict=True):
            assert ca.get(k) == v  # byte for byte, from A's host tier or Redis
            assert cb.get(k) == v[::-1]
        assert _corrupt(ca) == _corrupt(cb) == 0


def test_a_flipped_byte_under_the_daemons_own_key_is_a_counted_miss(
    keyed_daemons: tuple[Daemon, Daemon], redis_server: RedisServer
) -> None:
    from kvtier.service.client import Client

    a, _ = keyed_daemons
    rng = np.random.default_rng(6)
    keys = [rng.bytes(16).hex() for _ in range(4)]
    r = redis_server.client()
    with Client(a.url) as ca:
        before = set(r.scan_iter(match=f"{PREFIX}:*", count=1000))
        for k in keys:
            assert ca.put(k, rng.bytes(CHUNK)).stored == 1
        assert ca.lookup(keys).tiers == ("redis", "redis", "host", "host")
        names = sorted(set(r.scan_iter(match=f"{PREFIX}:*", count=1000)) - before)
        assert len(names) == 2  # the two oldest, demoted
        value = bytearray(r.get(names[0]))
        value[-1] ^= 0x01  # the last byte of the GCM tag
        r.set(names[0], bytes(value))
        assert sum(ca.get(k) is None for k in keys) == 1
        assert _corrupt(ca) == 1
        assert r.exists(names[0]) == 0  # its own key's value: deleted, so a put heals it
        assert r.exists(names[1]) == 1


def test_a_tenant_cannot_open_anothers_sealed_values_even_with_its_keys_and_redis_access(
    tmp_path: Path, redis_server: RedisServer
) -> None:
    """Hostile: Bob knows Alice's client keys and can write to Redis. Asking for her keys
    gives him misses; her sealed values copied over his own Redis values open for nobody
    (another tenant's AES key): each is a miss and a counted corruption, never her bytes."""
    from kvtier.service.client import Client

    prefix = f"tenants-{uuid.uuid4().hex[:8]}"
    tokens = {"alice": "alice-token-0123456789", "bob": "bob-token-0123456789ab"}
    cfg = sealed_config(tmp_path, "t", redis_server.url, prefix)
    cfg.write_text(
        cfg.read_text()
        + "\n[service.tokens]\n"
        + "".join(f'{t} = "{tok}"\n' for t, tok in tokens.items())
        # One chunk each in the host tier; the rest goes down to Redis, sealed.
        + f'\n[tenants]\ndefault_quota = {{ host = "{CHUNK}" }}\n'
    )
    rng = np.random.default_rng(7)
    keys = [rng.bytes(16).hex() for _ in range(4)]
    theirs = [rng.bytes(CHUNK) for _ in keys]
    mine = [rng.bytes(CHUNK) for _ in keys]
    r = redis_server.client()
    d = Daemon(cfg, tmp_path / "daemon-t.log")
    try:
        with Client(d.url, tokens["alice"]) as alice, Client(d.url, tokens["bob"]) as bob:
            for k, v in zip(keys, theirs, strict=True):
                assert alice.put(k, v).stored == 1
            assert alice.lookup(keys).tiers == ("redis", "redis", "redis", "host")
            alices = sorted(r.scan_iter(match=f"{prefix}:*", count=1000))
            assert len(alices) == 3

            # Her keys, guessed or leaked, name other chunks for him: all misses.
            assert bob.lookup(keys).hits == 0
            assert all(bob.get(k) is None for k in keys)

            for k, v in zip(keys, mine, strict=True):
                assert bob.put(k, v).stored == 1
            bobs = sorted(set(r.scan_iter(match=f"{prefix}:*", count=1000)) - set(alices))
            assert len(bobs) == 3
            assert not any(v[1000:1064] in r.get(n) for n in alices + bobs for v in theirs + mine)
            for ours, hers in zip(bobs, alices, strict=True):
                r.set(ours, r.get(hers))  # her sealed value, header and all, under his name

            got = [bob.get(k) for k in keys]
            assert not any(g in theirs for g in got)  # never her bytes
            assert got == [None, None, None, mine[3]]  # his three in Redis: misses
            assert _corrupt(bob) == 3
            assert [alice.get(k) for k in keys] == theirs  # hers untouched
    finally:
        rc = d.stop()
        assert rc in (0, -signal.SIGTERM), d.log.read_text()
