"""kvtier under a real LMCache 0.5.6 engine: the remote plug-in over a real daemon, and the
embedded storage plug-in.

The engine is LMCache's own (see tests/connectors/lmcache_engine.py: only the GPU copy is
a CPU stand-in); daemons are real ``kvtier serve`` processes on free ports. Keys are made
restart-stable the documented way (``pre_caching_hash_algorithm: sha256_cbor`` and one
``PYTHONHASHSEED`` in every process).
"""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import re
import subprocess
import sys
import time
import weakref
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

pytest.importorskip("lmcache", reason="LMCache is not installed (pip install 'kvtier[lmcache]')")

import torch
import yaml
from lmcache.utils import CacheEngineKey
from lmcache.v1.distributed.api import ObjectKey
from lmcache.v1.memory_management import MemoryFormat

from kvtier.connectors.lmcache.keys import engine_key, object_key
from kvtier.connectors.lmcache.pool import LoadPool
from kvtier.connectors.lmcache.remote import KVTierRemoteConnector
from kvtier.connectors.lmcache.settings import daemon_settings, params_settings, shared_bytes
from kvtier.connectors.lmcache.spans import spans
from kvtier.errors import ConfigError
from kvtier.service.client import Client
from tests.connectors.lmcache_engine import (
    CHUNK,
    HASH_SEED,
    PLUGIN,
    REMOTE,
    TOKEN_BYTES,
    Engine,
    engine,
    nvme_daemon,
    nvme_toml,
    plugin_config,
    prompt,
    remote_config,
)
from tests.service.conftest import TOKENS, Daemon, free_port, start_daemon

N_TOKENS = 4 * CHUNK + 5  # four full chunks and a partial one
FULL = 4 * CHUNK


def _equal(out: torch.Tensor, kv: torch.Tensor, n: int) -> bool:
    return bool(torch.equal(out[: n * TOKEN_BYTES], kv[: n * TOKEN_BYTES]))


@pytest.fixture
def daemons(tmp_path: Path) -> Iterator[list[Daemon]]:
    started: list[Daemon] = []
    yield started
    for d in started:
        d.stop()


# -- keys and settings (no engine) -----------------------------------------------------------


def test_keys_separate_model_rank_dtype_tags_and_salt() -> None:
    base = {"model_name": "m", "world_size": 2, "worker_id": 0, "chunk_hash": 7}
    variants = [
        CacheEngineKey(**base, dtype=torch.float16),
        CacheEngineKey(**{**base, "model_name": "n"}, dtype=torch.float16),
        CacheEngineKey(**{**base, "worker_id": 1}, dtype=torch.float16),
        CacheEngineKey(**{**base, "world_size": 4}, dtype=torch.float16),
        CacheEngineKey(**base, dtype=torch.bfloat16),
        CacheEngineKey(**{**base, "chunk_hash": 8}, dtype=torch.float16),
        CacheEngineKey(**base, dtype=torch.float16, request_configs={"lmcache.tag.salt": "a"}),
        CacheEngineKey(**base, dtype=torch.float16, request_configs={"lmcache.tag.salt": "b"}),
        # '@' is LMCache's separator in to_string(): the mapping must not rely on it.
        CacheEngineKey(**{**base, "model_name": "m@2"}, dtype=torch.float16),
    ]
    keys = [engine_key(k) for k in variants]
    assert len(set(keys)) == len(keys)
    assert all(len(k) == 16 for k in keys)
    # The same key built again (another process would build the same) maps the same.
    assert engine_key(CacheEngineKey(**base, dtype=torch.float16)) == keys[0]

    obj = {"chunk_hash": b"\x01" * 8, "model_name": "m", "kv_rank": 0}
    objects = [
        ObjectKey(**obj),
        ObjectKey(**obj, cache_salt="alice"),
        ObjectKey(**obj, cache_salt="bob"),
        ObjectKey(**{**obj, "kv_rank": 1}),
        ObjectKey(**obj, object_group_id=1),
        ObjectKey(**{**obj, "model_name": "n"}),
    ]
    okeys = [object_key(k) for k in objects]
    assert len(set(okeys)) == len(okeys)
    assert not set(okeys) & set(keys)


def test_settings_fail_with_the_key_named() -> None:
    with pytest.raises(ConfigError, match=r"remote_storage_plugin\.kvtier\.url"):
        daemon_settings({}, "remote_storage_plugin.kvtier")
    with pytest.raises(ConfigError, match="url"):
        daemon_settings({"p.url": "ftp://x"}, "p")
    with pytest.raises(ConfigError, match="timeout_s"):
        daemon_settings({"p.url": "http://x", "p.timeout_s": "soon"}, "p")
    with pytest.raises(ConfigError, match="adapter_params"):
        params_settings({"url": "http://x", "host": "y"})
    with pytest.raises(ConfigError, match=r"p\.shared_bytes"):
        shared_bytes({"p.shared_bytes": "lots"}, "p")
    with pytest.raises(ConfigError, match=r"p\.shared_bytes"):
        shared_bytes({"p.shared_bytes": -1}, "p")
    assert shared_bytes({"p.shared_bytes": "64MiB"}, "p") == 64 << 20
    assert shared_bytes({}, "p") == 1 << 30
    s = daemon_settings({"p.url": "http://127.0.0.1:1", "p.token": "t"}, "p")
    assert (s.url, s.token) == ("http://127.0.0.1:1", "t")


def test_docs_config_blocks_are_read_as_documented() -> None:
    """docs/lmcache.md's YAML blocks: LMCache takes them, and kvtier reads its keys out of
    them with the documented values (the remote block's defaults included)."""
    from lmcache.v1.config import LMCacheEngineConfig

    text = (Path(__file__).parents[2] / "docs" / "lmcache.md").read_text()
    blocks = [yaml.safe_load(b) for b in re.findall(r"```yaml\n(.*?)```", text, re.S)]
    remote = next(b for b in blocks if "remote_storage_plugins" in b)
    embedded = next(b for b in blocks if "storage_plugins" in b)
    for block in (remote, embedded):
        LMCacheEngineConfig.from_dict(block)
    where = "remote_storage_plugin.kvtier"
    s = daemon_settings(remote["extra_config"], where)
    assert (s.url, s.timeout_s) == ("http://127.0.0.1:8470", 5.0)
    assert shared_bytes(remote["extra_config"], where) == 1 << 30
    assert remote["extra_config"][f"{where}.class_name"] == KVTierRemoteConnector.__name__
    assert embedded["extra_config"]["storage_plugin.kvtier.class_name"] == "KVTierStoragePlugin"


# -- the remote plug-in ------------------------------------------------------------------------


def test_remote_round_trip_with_tenants_and_salts(
    tmp_path: Path, daemons: list[Daemon], caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="kvtier.service.client")
    d = start_daemon(tmp_path, tokens=TOKENS)
    daemons.append(d)
    tokens, kv = prompt(1, N_TOKENS)
    salt_a = {"request_configs": {"lmcache.tag.cache_salt": "a"}}
    salt_b = {"request_configs": {"lmcache.tag.cache_salt": "b"}}
    with engine(remote_config(d.url, TOKENS["alice"])) as alice:
        assert REMOTE in alice.backends()
        alice.store(tokens, kv)
        assert alice.wait_stored(tokens, REMOTE) == FULL, d.log.read_text()[-4000:]
        alice.drop_local()
        assert alice.lookup(tokens) == FULL
        n, out = alice.retrieve(tokens)
        assert n == FULL and _equal(out, kv, n)
        # A loopback daemon: the values went through its same-host channel, not HTTP bodies.
        shm = [r for r in caplog.records if "values through shared memory" in r.getMessage()]
        assert shm, caplog.text

        # A salted prompt is another chunk: the unsalted copy does not serve it.
        assert alice.lookup(tokens, REMOTE, request_configs=salt_a["request_configs"]) == 0
        alice.store(tokens, kv, **salt_a)
        assert alice.wait_stored(tokens, REMOTE, **salt_a) == FULL, d.log.read_text()[-4000:]
        alice.drop_local()
        assert alice.lookup(tokens, REMOTE, request_configs=salt_a["request_configs"]) == FULL
        assert alice.lookup(tokens, REMOTE, request_configs=salt_b["request_configs"]) == 0
        n, out = alice.retrieve(tokens, **salt_a)
        assert n == FULL and _equal(out, kv, n)

    with engine(remote_config(d.url, TOKENS["bob"])) as bob:
        # Another tenant of the same daemon sees none of alice's chunks.
        assert bob.lookup(tokens, REMOTE) == 0
        n, _ = bob.retrieve(tokens)
        assert n == 0


def test_remote_hits_after_restarting_daemon_and_engine_process(
    tmp_path: Path, daemons: list[Daemon]
) -> None:
    d = nvme_daemon(tmp_path / "daemon")
    daemons.append(d)
    # Store from another engine process, which then exits.
    env = {**os.environ, "PYTHONHASHSEED": HASH_SEED}
    cmd = [
        sys.executable,
        "-m",
        "tests.connectors.lmcache_engine",
        "store",
        d.url,
        "5",
        str(N_TOKENS),
    ]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=400, env=env)
    assert run.returncode == 0 and f"stored {FULL}" in run.stdout, (
        run.stdout[-2000:] + run.stderr[-4000:]
    )
    assert d.stop() in (0, -15)
    daemons.append(nvme_daemon(tmp_path / "daemon", port=int(d.url.rsplit(":", 1)[1])))

    tokens, kv = prompt(5, N_TOKENS)
    with engine(remote_config(d.url)) as e:
        assert e.lookup(tokens) == FULL
        n, out = e.retrieve(tokens)
        assert n == FULL and _equal(out, kv, n)


def test_remote_daemon_down_then_back_serves_misses_then_hits(
    tmp_path: Path, daemons: list[Daemon], caplog: pytest.LogCaptureFixture
) -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    tokens, kv = prompt(2, N_TOKENS)
    caplog.set_level(logging.WARNING, logger="kvtier")
    with engine(remote_config(url)) as e:  # no daemon yet
        assert REMOTE in e.backends()
        e.store(tokens, kv)
        # LMCache keeps serving from its local CPU copy while the daemon is down.
        n, out = e.retrieve(tokens)
        assert n == FULL and _equal(out, kv, n)
        e.drop_local(tokens)
        assert e.lookup(tokens) == 0
        n, _ = e.retrieve(tokens)
        assert n == 0
        assert any("serving misses" in r.getMessage() for r in caplog.records), caplog.text

        # The daemon starts mid-run: after the hold-off, stores and hits go through it.
        daemons.append(start_daemon(tmp_path, port=port))
        deadline = time.monotonic() + 30  # the link's hold-off is at most MAX_HOLD_S
        while True:
            e.drop_local()
            e.store(tokens, kv)
            if e.wait_stored(tokens, REMOTE, timeout_s=2) == FULL:
                break
            assert time.monotonic() < deadline, "the remote plug-in never reconnected"
        e.drop_local()
        n, out = e.retrieve(tokens)
        assert n == FULL and _equal(out, kv, n)


def test_remote_refusing_daemon_drops_stores_with_a_reason(
    tmp_path: Path, daemons: list[Daemon], caplog: pytest.LogCaptureFixture
) -> None:
    # Values above the daemon's max_value_bytes are refused: every store fails.
    d = start_daemon(tmp_path, "--set", f"service.max_value_bytes={CHUNK * TOKEN_BYTES // 2}")
    daemons.append(d)
    tokens, kv = prompt(3, N_TOKENS)
    caplog.set_level(logging.WARNING, logger="kvtier")
    with engine(remote_config(d.url)) as e:
        e.store(tokens, kv)
        assert e.wait_stored(tokens, REMOTE, timeout_s=3) == 0
        assert any("max_value_bytes" in r.getMessage() for r in caplog.records), caplog.text
        n, out = e.retrieve(tokens)  # the local CPU copy still serves
        assert n == FULL and _equal(out, kv, n)


def _connector(e: Engine) -> KVTierRemoteConnector:
    """The plug-in object under LMCache's instrumented wrapper."""
    c = e.backend(REMOTE).connection
    c = getattr(c, "_connector", c)
    assert isinstance(c, KVTierRemoteConnector)
    return c


def _pool_of(c: KVTierRemoteConnector) -> LoadPool:
    """The connector's load pool (made at its first load)."""
    assert c.load_pool is not None, "the remote plug-in made no load pool"
    return c.load_pool


def _shared_maps() -> set[str]:
    """Mappings of kvtier's same-host shared memory in this process (an earlier test's
    may still be unmapping: callers look for new ones)."""
    lines = Path("/proc/self/maps").read_text().splitlines()
    return {line for line in lines if "kvtier-shm" in line}


def _two_slot_pool(tmp_path: Path, daemons: list[Daemon]) -> tuple[Daemon, dict[str, Any]]:
    """A daemon with an nvme tier, and the remote plug-in's config with a load pool of
    two chunk slots (a load of four chunks then also needs LMCache's own memory)."""
    d = nvme_daemon(tmp_path / "daemon")
    daemons.append(d)
    cfg = remote_config(d.url)
    cfg["extra_config"]["remote_storage_plugin.kvtier.shared_bytes"] = 2 * CHUNK * TOKEN_BYTES
    return d, cfg


def test_remote_loads_land_in_the_shared_pool_then_in_lmcache_memory(
    tmp_path: Path, daemons: list[Daemon]
) -> None:
    """A pool of two chunks: a four-chunk load takes both slots (no copy on this side)
    and two LMCache objects; LMCache's write-back holds the slots until it drops its
    copies. A daemon restarted under the engine gets a new pool, and bytes stay equal."""
    d, cfg = _two_slot_pool(tmp_path, daemons)
    tokens, kv = prompt(6, N_TOKENS)
    with engine(cfg) as e:
        c = _connector(e)
        e.store(tokens, kv)
        assert e.wait_stored(tokens, REMOTE) == FULL
        e.drop_local()
        n, out = e.retrieve(tokens)
        assert n == FULL and _equal(out, kv, n)
        pool = _pool_of(c)
        assert pool.slots == 2
        assert pool.taken_total == 2
        assert pool.in_use == 2  # LMCache keeps the loaded chunks in its CPU cache
        e.drop_local()
        assert pool.in_use == 0

        # The daemon restarts: its new channel does not map the old pool, so the next
        # load makes another one.
        assert d.stop() in (0, -15)
        daemons.append(nvme_daemon(tmp_path / "daemon", port=int(d.url.rsplit(":", 1)[1])))
        deadline = time.monotonic() + 30
        while True:
            n, out = e.retrieve(tokens)
            if n == FULL:
                break
            assert n == 0 and time.monotonic() < deadline, "the remote plug-in never came back"
            time.sleep(0.2)
            e.drop_local()
        assert _equal(out, kv, n)
        # Loads over HTTP (into either memory) while the client holds off its same-host
        # channel, then a new channel and a new pool.
        while c.load_pool is None or c.load_pool is pool:
            assert time.monotonic() < deadline, "the remote plug-in made no new pool"
            time.sleep(0.2)
            e.drop_local()
            n, out = e.retrieve(tokens)
            assert n == FULL and _equal(out, kv, n)
        e.drop_local()
        n, out = e.retrieve(tokens)
        assert n == FULL and _equal(out, kv, n)
        assert c.load_pool.in_use == 2  # this load, into the new pool


def _same_host_gets(url: str) -> int:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    found = re.search(
        r'^kvtier_same_host_requests_total\{op="get",status="ok"\} (\d+)$', text, re.M
    )
    return int(found.group(1)) if found else 0


def test_remote_load_asks_span_by_span_and_stops_at_a_short_one(
    tmp_path: Path, daemons: list[Daemon]
) -> None:
    """A load into the shared pool (two slots here) asks for each span of memory objects
    in order, on one thread; when a span comes back short (a chunk gone since the
    lookup), the objects after it are freed without a request, and what came before the
    gap is kept, bytes equal."""
    d, cfg = _two_slot_pool(tmp_path, daemons)
    tokens, kv = prompt(8, N_TOKENS)
    with engine(cfg) as e:
        c = _connector(e)
        e.store(tokens, kv)
        assert e.wait_stored(tokens, REMOTE) == FULL
        e.drop_local()
        keys = [key for _, _, key in e.engine.token_database.process_tokens(tokens)][:4]
        assert all(isinstance(k, CacheEngineKey) for k in keys)

        # All four held: the pool's two slots are one span, LMCache's memory one or two
        # more (its objects need not lie back to back); one get per span.
        before = _same_host_gets(d.url)
        got, _ = c._load_in_place(keys)  # one pass over the keys
        pool = _pool_of(c)
        assert len(got) == 4
        n_spans = len(spans(got, CHUNK * TOKEN_BYTES))
        assert n_spans >= 2 and _same_host_gets(d.url) - before == n_spans
        for i, obj in enumerate(got):
            chunk = kv[i * CHUNK * TOKEN_BYTES : (i + 1) * CHUNK * TOKEN_BYTES]
            assert torch.equal(torch.frombuffer(obj.byte_array, dtype=torch.uint8), chunk)
            obj.ref_count_down()
        assert pool.in_use == 0

        # The second chunk goes after the lookup: the first span comes back with one value.
        with Client(d.url) as client:
            assert client.delete(engine_key(keys[1]))
        before = _same_host_gets(d.url)
        got, _ = c._load_in_place(keys)  # one pass over the keys
        assert _same_host_gets(d.url) - before == 1  # the second span was never asked for
        assert len(got) == 1
        first = kv[: CHUNK * TOKEN_BYTES]
        assert torch.equal(torch.frombuffer(got[0].byte_array, dtype=torch.uint8), first)
        assert pool.in_use == 1
        got[0].ref_count_down()
        assert pool.in_use == 0


def test_remote_without_a_pool_copies_and_serves(tmp_path: Path, daemons: list[Daemon]) -> None:
    d = start_daemon(tmp_path)
    daemons.append(d)
    cfg = remote_config(d.url)
    cfg["extra_config"]["remote_storage_plugin.kvtier.shared_bytes"] = 0
    tokens, kv = prompt(7, N_TOKENS)
    with engine(cfg) as e:
        e.store(tokens, kv)
        assert e.wait_stored(tokens, REMOTE) == FULL
        e.drop_local()
        n, out = e.retrieve(tokens)
        assert n == FULL and _equal(out, kv, n)
        assert _connector(e).load_pool is None


def test_remote_maps_no_shared_memory_until_its_first_load(
    tmp_path: Path, daemons: list[Daemon]
) -> None:
    """An engine whose connector never loads maps none of the load pool; the first load
    makes it, no larger than LMCache's local CPU cache (the engine's 0.05 GB here, where
    the default pool is 1 GiB); bytes equal."""
    d = start_daemon(tmp_path)
    daemons.append(d)
    tokens, kv = prompt(9, N_TOKENS)
    gc.collect()
    before = _shared_maps()
    with engine(remote_config(d.url)) as e:
        c = _connector(e)
        assert not _shared_maps() - before, "the connector mapped shared memory when built"
        e.store(tokens, kv)
        assert e.wait_stored(tokens, REMOTE) == FULL
        e.drop_local()
        n, out = e.retrieve(tokens)
        assert n == FULL and _equal(out, kv, n)
        assert _pool_of(c).array.nbytes <= int(0.05 * 2**30)


def test_remote_list_names_the_chunks_it_stored_while_the_daemon_holds_them(
    tmp_path: Path, daemons: list[Daemon]
) -> None:
    d = start_daemon(tmp_path)
    daemons.append(d)
    tokens, kv = prompt(10, N_TOKENS)
    with engine(remote_config(d.url)) as e:
        c = _connector(e)
        e.store(tokens, kv)
        assert e.wait_stored(tokens, REMOTE) == FULL
        keys = [key for _, _, key in e.engine.token_database.process_tokens(tokens)][:4]
        listed = asyncio.run(c.list())
        assert {k.to_string() for k in keys} <= set(listed)
        with Client(d.url) as client:  # gone behind the connector's back
            assert client.delete(engine_key(keys[0]))
        assert c.remove_sync(keys[1])
        listed = asyncio.run(c.list())
        assert keys[0].to_string() not in listed and keys[1].to_string() not in listed
        assert {k.to_string() for k in keys[2:]} <= set(listed)


def test_two_kvtier_remote_plugins_in_one_config_each_use_their_own_daemon(
    tmp_path: Path, daemons: list[Daemon]
) -> None:
    """``kvtier.a`` and ``kvtier.b`` through ``KVTierConnectorAdapter``: LMCache builds one
    connector per name, each with its own settings, and both daemons get the chunks."""
    a, b = start_daemon(tmp_path), start_daemon(tmp_path)
    daemons += [a, b]
    extra: dict[str, Any] = {}
    for name, d in (("kvtier.a", a), ("kvtier.b", b)):
        extra[f"remote_storage_plugin.{name}.module_path"] = "kvtier.connectors.lmcache"
        extra[f"remote_storage_plugin.{name}.class_name"] = "KVTierConnectorAdapter"
        extra[f"remote_storage_plugin.{name}.url"] = d.url
    cfg = {"remote_storage_plugins": ["kvtier.a", "kvtier.b"], "extra_config": extra}
    tokens, kv = prompt(11, N_TOKENS)
    with engine(cfg) as e:
        e.store(tokens, kv)
        for name in ("RemoteBackend-kvtier.a", "RemoteBackend-kvtier.b"):
            assert e.wait_stored(tokens, name) == FULL
        keys = [key for _, _, key in e.engine.token_database.process_tokens(tokens)][:4]
    for d in (a, b):
        with Client(d.url) as client:
            assert client.lookup([engine_key(k) for k in keys]).hits == 4


def test_remote_pool_memory_is_released_when_lmcache_closes(
    tmp_path: Path, daemons: list[Daemon]
) -> None:
    d = start_daemon(tmp_path)
    daemons.append(d)
    tokens, kv = prompt(8, N_TOKENS)
    with engine(remote_config(d.url)) as e:
        e.store(tokens, kv)
        assert e.wait_stored(tokens, REMOTE) == FULL
        e.drop_local()
        n, out = e.retrieve(tokens)
        assert n == FULL and _equal(out, kv, n)
        memory = weakref.ref(_pool_of(_connector(e)).array.base)  # the mapping's owner
    gc.collect()
    assert memory() is None, "the load pool's memory outlived the engine"


def test_load_pool_hands_out_runs_and_frees_once() -> None:
    chunk = 64
    pool = LoadPool(np.zeros(4 * chunk + 10, dtype=np.uint8), chunk)
    shape, dtype = [torch.Size([2, 32])], [torch.uint8]
    a = pool.take(3, shape, dtype, MemoryFormat.KV_2LTD)
    assert [o.meta.address for o in a] == [0, chunk, 2 * chunk]
    assert pool.batched_allocate(shape, dtype, 2) is None  # all or none
    assert pool.in_use == 3
    a[1].ref_count_down()  # LMCache's release path
    a[1].ref_count_down()  # a second release finds it freed (LMCache warns, nothing breaks)
    assert pool.in_use == 2
    b = pool.take(3, shape, dtype, MemoryFormat.KV_2LTD)  # the freed slot, then the last
    assert [o.meta.address for o in b] == [chunk, 3 * chunk]
    b[0].tensor.fill_(7)
    assert bytes(b[0].byte_array) == b"\x07" * chunk
    with pytest.raises(ValueError, match="holds no chunk"):
        LoadPool(np.zeros(chunk - 1, dtype=np.uint8), chunk)


# -- the embedded storage plug-in --------------------------------------------------------------


def _nvme_config(tmp: Path) -> str:
    path = tmp / "kvtier.toml"
    path.write_text(nvme_toml(tmp))
    return str(path)


def test_plugin_host_tier_over_nvme_is_written_down_at_close(tmp_path: Path) -> None:
    """A host tier above the nvme tier: the chunks only the host tier held are moved
    into the nvme tier when LMCache closes the plug-in, so a new engine hits them all."""
    path = tmp_path / "kvtier.toml"
    host = "\n".join(["[[tiers]]", 'kind = "host"', 'capacity_bytes = "16MiB"', 'pin = "off"', ""])
    path.write_text(host + nvme_toml(tmp_path))
    cfg = plugin_config(str(path))
    tokens, kv = prompt(5, N_TOKENS)
    with engine(cfg) as e:
        e.store(tokens, kv)
        assert e.wait_stored(tokens, PLUGIN) == FULL
        stats = e.backend(PLUGIN).store.stats()
        assert [t.used_bytes > 0 for t in stats.tiers] == [True, False]  # host only, so far
    with engine(cfg) as e:
        assert e.lookup(tokens) == FULL
        n, out = e.retrieve(tokens)
        assert n == FULL and _equal(out, kv, n)


def test_plugin_round_trip_and_restart(tmp_path: Path) -> None:
    cfg = plugin_config(_nvme_config(tmp_path))
    tokens, kv = prompt(4, N_TOKENS)
    with engine(cfg) as e:
        assert PLUGIN in e.backends()
        e.store(tokens, kv)
        assert e.wait_stored(tokens, PLUGIN) == FULL
        e.drop_local()
        assert e.lookup(tokens) == FULL
        n, out = e.retrieve(tokens)
        assert n == FULL and _equal(out, kv, n)
        # Another prompt's salt-tagged twin is a different chunk.
        salted = {"lmcache.tag.cache_salt": "x"}
        assert e.lookup(tokens, PLUGIN, request_configs=salted) == 0

    # A new engine and a new kvtier store: the nvme tier recovers the chunks.
    with engine(cfg) as e:
        assert e.lookup(tokens) == FULL
        n, out = e.retrieve(tokens)
        assert n == FULL and _equal(out, kv, n)
