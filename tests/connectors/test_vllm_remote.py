"""The connector's daemon-mode store (connectors/vllm/remote.py) against a real daemon."""

from __future__ import annotations

import pytest

pytest.importorskip("fastapi", reason="needs the service extra: pip install 'kvtier[service]'")
pytest.importorskip("uvicorn", reason="needs the service extra: pip install 'kvtier[service]'")
pytest.importorskip("httpx", reason="needs the service extra: pip install 'kvtier[service]'")

import logging
import os
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from kvtier.connectors.vllm.keys import rank_keys
from kvtier.connectors.vllm.remote import DaemonLookup, RemoteStore
from kvtier.connectors.vllm.settings import DaemonSettings, config_from_extra, daemon_from_extra
from kvtier.errors import ConfigError
from tests.service.conftest import Daemon, free_port, start_daemon

CHUNK_BYTES = 64 << 10


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    d = start_daemon(tmp_path_factory.mktemp("remote"))  # max_value_bytes 1 MiB
    try:
        yield d
    finally:
        d.stop()


def _chunks(n: int, seed: int) -> tuple[list[bytes], np.ndarray]:
    rng = np.random.default_rng(seed)
    keys = [rng.bytes(16) for _ in range(n)]
    return keys, rng.integers(0, 256, n * CHUNK_BYTES, dtype=np.uint8)


def test_put_lookup_get_round_trip(daemon: Daemon) -> None:
    store = RemoteStore(DaemonSettings(daemon.url), CHUNK_BYTES)
    try:
        keys, data = _chunks(3, 1)
        res = store.put(keys, data).result()
        assert res.stored == 3
        assert store.put(keys, data).result().present == 3  # write-once, like the store
        assert store.lookup([*keys, os.urandom(16)]).hits == 3
        dst = np.zeros_like(data)
        got = store.get(keys, dst).result()
        assert got.chunks == 3 and got.value_bytes == (CHUNK_BYTES,) * 3
        assert np.array_equal(dst, data)
    finally:
        store.close()


def test_loads_land_in_staging_shared_with_the_daemon(daemon: Daemon) -> None:
    store = RemoteStore(DaemonSettings(daemon.url), CHUNK_BYTES)
    try:
        keys, data = _chunks(4, 2)
        assert store.put(keys, data).result().stored == 4
        staging = store.staging(data.nbytes)
        assert staging is not None and staging.nbytes == data.nbytes
        assert store.staging(CHUNK_BYTES) is not None  # reused, not reallocated
        got = store.get(keys, staging).result()
        assert got.chunks == 4 and np.array_equal(staging, data)
    finally:
        store.close()


def test_saves_from_the_save_staging_copy_nothing_on_the_client(daemon: Daemon) -> None:
    """The worker gathers a save into ``save_staging``; the put then sends offsets only:
    the client never fills a scratch region (its copy), and the daemon stores the bytes."""
    store = RemoteStore(DaemonSettings(daemon.url), CHUNK_BYTES)
    try:
        keys, data = _chunks(4, 5)
        out = store.save_staging(data.nbytes)
        assert out is not None and out.nbytes == data.nbytes
        assert out.ctypes.data != store.staging(data.nbytes).ctypes.data  # type: ignore[union-attr]
        out[:] = data
        assert store.put(keys, out).result().stored == 4
        shm = store._client._shm
        assert shm is not None
        assert all(link.scratch is None for link in shm._idle), "the put copied into scratch"
        dst = np.zeros_like(data)
        assert store.get(keys, dst).result().chunks == 4
        assert np.array_equal(dst, data)
    finally:
        store.close()


def test_scheduler_lookup_uses_the_workers_rank_keys(daemon: Daemon) -> None:
    store = RemoteStore(DaemonSettings(daemon.url), CHUNK_BYTES)
    try:
        salt = b"rank-salt-for-test\0"
        logical, data = _chunks(4, 2)
        store.put(rank_keys(salt, logical[:2]), data[: 2 * CHUNK_BYTES]).result()
        look = DaemonLookup(store, world_size=1)
        assert not look.ready()
        look.salts.add(salt)
        assert look.ready()
        assert look.hits(logical) == 2
        assert look.hits(logical[2:]) == 0
    finally:
        store.close()


def test_too_small_value_limit_fails_at_start(daemon: Daemon) -> None:
    with pytest.raises(ConfigError, match="max_value_bytes"):
        RemoteStore(DaemonSettings(daemon.url), 2 << 20)


def test_daemon_down_is_a_miss_with_a_logged_reason(caplog: pytest.LogCaptureFixture) -> None:
    url = f"http://127.0.0.1:{free_port()}"  # nobody listens there
    with caplog.at_level(logging.WARNING, logger="kvtier.connectors.vllm.remote"):
        store = RemoteStore(DaemonSettings(url, timeout_s=0.2), CHUNK_BYTES)
        keys, data = _chunks(2, 3)
        assert store.put(keys, data).result().failed == 2
        assert store.lookup(keys).hits == 0
        assert store.get(keys, np.zeros_like(data)).result().chunks == 0
        store.close()
    warnings = [r for r in caplog.records if "serving misses" in r.getMessage()]
    assert len(warnings) == 1  # rate-limited: one line, not one per call


def test_daemon_keys_in_the_extra_config(tmp_path: Path) -> None:
    extra = {"url": "http://127.0.0.1:8470", "token": "t0k", "daemon_timeout_s": 0.3}
    assert daemon_from_extra(extra) == DaemonSettings("http://127.0.0.1:8470", "t0k", 0.3)
    assert daemon_from_extra({}) is None
    config_from_extra({**extra, "store.chunk_tokens": 64})  # not taken for kvtier settings
    with pytest.raises(ConfigError, match="url"):
        daemon_from_extra({"url": "127.0.0.1:8470"})
    with pytest.raises(ConfigError, match="token"):
        daemon_from_extra({"token": "t0k"})
    with pytest.raises(ConfigError, match="daemon_timeout_s"):
        daemon_from_extra({"url": "http://x", "daemon_timeout_s": 0})
