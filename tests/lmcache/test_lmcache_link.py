"""The LMCache plug points' daemon link: a refusal is not an outage."""

from __future__ import annotations

from pathlib import Path

from kvtier.connectors.lmcache.link import DaemonLink, DaemonSettings
from kvtier.errors import InputError, TransportError
from kvtier.keys import ChunkKey
from kvtier.service.breaker import Breaker
from tests.service.conftest import start_daemon


def _refuse() -> int:
    raise InputError("413: value too large")


def _fail() -> int:
    raise TransportError("connection refused")


def test_a_refused_request_answers_the_miss_without_holding_off() -> None:
    b = Breaker("http://127.0.0.1:1", dropped="stores", refused="the value")
    assert b.call("store", _refuse, -1) == -1
    assert b.available() and b.refused_total == 1 and b.failures_total == 0
    assert b.call("lookup", lambda: 3, 0) == 3
    assert b.call("lookup", _fail, 0) == 0  # an outage still holds off
    assert not b.available() and b.failures_total == 1


def test_a_value_over_the_daemons_limit_drops_alone_and_stored_keys_still_hit(
    tmp_path: Path,
) -> None:
    d = start_daemon(tmp_path, "--set", "service.max_value_bytes=4096")
    try:
        link = DaemonLink(DaemonSettings(d.url))
        kept = [ChunkKey(bytes([i]) * 16) for i in range(3)]
        assert link.put_many(kept, [memoryview(b"k" * 1024)] * 3) is not None
        big = ChunkKey(b"\xff" * 16)
        res = link.put_many([big, kept[0]], [memoryview(b"b" * 8192), memoryview(b"k" * 1024)])
        assert res is not None and res.rejected == 1 and res.stored + res.present == 1
        assert link.hits(kept) == 3  # asked at once: no hold-off after the refusal
        assert link.available()
        assert link.present([big, *kept]) == [False, True, True, True]
        link.close()
    finally:
        d.stop()
