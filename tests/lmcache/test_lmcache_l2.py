"""``KVTierL2Adapter`` against LMCache's L2 contract, over a real ``kvtier serve`` daemon.

What LMCache's ``lmcache server`` relies on beyond moving bytes: the byte accounting and
listener events (``_notify_keys_*``) that drive its eviction and its coordinator's cache
events, per-key lookup answers, a declared capacity, and every task completing.
"""

from __future__ import annotations

import select
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("lmcache", reason="LMCache is not installed (pip install 'kvtier[lmcache]')")

import torch
from lmcache.v1.distributed.api import MemoryLayoutDesc, ObjectKey
from lmcache.v1.memory_management import MemoryFormat, MemoryObjMetadata, TensorMemoryObj
from lmcache.v1.platform import consume_fd

from kvtier.connectors.lmcache.keys import object_key
from kvtier.connectors.lmcache.l2 import KVTierL2Adapter
from kvtier.errors import ConfigError
from kvtier.service.client import Client
from tests.service.conftest import Daemon, start_daemon

LAYOUT = {0: MemoryLayoutDesc(shapes=[], dtypes=[])}


class Listener:
    """Records what the adapter tells LMCache's listeners."""

    def __init__(self) -> None:
        self.stored: list[tuple[ObjectKey, int]] = []
        self.accessed: list[ObjectKey] = []
        self.deleted: list[ObjectKey] = []

    def on_l2_keys_stored(self, keys: list[ObjectKey], sizes: list[int]) -> None:
        self.stored += zip(keys, sizes, strict=True)

    def on_l2_keys_accessed(self, keys: list[ObjectKey]) -> None:
        self.accessed += keys

    def on_l2_keys_deleted(self, keys: list[ObjectKey]) -> None:
        self.deleted += keys


class Bytes:
    """A memory object reduced to its ``byte_array`` (no ``get_size``)."""

    def __init__(self, data: bytes) -> None:
        self._data = bytearray(data)

    @property
    def byte_array(self) -> memoryview:
        return memoryview(self._data)


def key(i: int, salt: str = "") -> ObjectKey:
    return ObjectKey(
        chunk_hash=ObjectKey.IntHash2Bytes(i), model_name="m", kv_rank=0, cache_salt=salt
    )


def obj(nbytes: int, fill: int = 1) -> TensorMemoryObj:
    raw = torch.full((nbytes,), fill, dtype=torch.uint8)
    meta = MemoryObjMetadata(
        shape=torch.Size([nbytes]),
        dtype=torch.uint8,
        address=0,
        phy_size=nbytes,
        fmt=MemoryFormat.KV_2LTD,
        ref_count=1,
    )
    return TensorMemoryObj(raw, meta, parent_allocator=None)


def _wait(fd: int) -> None:
    poll = select.poll()
    poll.register(fd, select.POLLIN)
    assert poll.poll(10_000), "the task was never signalled"
    consume_fd(fd)


def store(a: KVTierL2Adapter, keys: list[ObjectKey], objs: list[Any]) -> int:
    """Store and wait; the task's result (>= 0: success)."""
    task = a.submit_store_task(keys, objs)
    deadline = time.monotonic() + 10
    while True:
        done = a.pop_completed_store_tasks()
        if task in done:
            return int(done[task])
        assert time.monotonic() < deadline, "the store task never completed"
        time.sleep(0.01)


def lookup(a: KVTierL2Adapter, keys: list[ObjectKey]) -> list[bool]:
    task = a.submit_lookup_and_lock_task(keys, LAYOUT)
    _wait(a.get_lookup_and_lock_event_fd())
    bitmap = a.query_lookup_and_lock_result(task)
    assert bitmap is not None
    return [bitmap.test(i) for i in range(len(keys))]


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    d = start_daemon(tmp_path_factory.mktemp("l2"))
    yield d
    d.stop()


@pytest.fixture
def adapter(daemon: Daemon) -> Iterator[tuple[KVTierL2Adapter, Listener]]:
    a = KVTierL2Adapter({"url": daemon.url})
    listener = Listener()
    a.register_listener(listener)
    yield a, listener
    a.close()


def test_delete_tells_lmcache_which_keys_left_and_gives_their_bytes_back(
    adapter: tuple[KVTierL2Adapter, Listener], daemon: Daemon
) -> None:
    a, listener = adapter
    k1, k2, never = key(101, "alice"), key(102, "bob"), key(103)
    assert store(a, [k1, k2], [obj(100), obj(40)]) >= 0
    assert dict(listener.stored) == {k1: 100, k2: 40}
    assert a.get_usage().total_bytes_used == 140
    a.delete([k1, never])
    assert listener.deleted == [k1]
    usage = a.get_usage()
    assert usage.total_bytes_used == 40 and dict(usage.bytes_by_cache_salt) == {"bob": 40}
    assert lookup(a, [k1, k2]) == [False, True]
    # Gone from the daemon behind the adapter's back (its eviction): a delete still
    # tells LMCache, with the size it was told at the store.
    with Client(daemon.url) as client:
        assert client.delete(object_key(k2))
    a.delete([k2])
    assert listener.deleted == [k1, k2]
    assert a.get_usage().total_bytes_used == 0


def test_a_store_whose_objects_have_no_size_method_still_completes(
    adapter: tuple[KVTierL2Adapter, Listener],
) -> None:
    """The bytes are what the adapter sends (``byte_array``); nothing else is asked of the
    object, and the task completes whatever happens inside it."""
    a, listener = adapter
    k = key(201)
    assert store(a, [k], [Bytes(b"z" * 24)]) >= 0
    assert listener.stored == [(k, 24)]
    task = a.submit_store_task([key(202)], [object()])  # no byte_array: the task fails
    deadline = time.monotonic() + 10
    while task not in (done := a.pop_completed_store_tasks()):
        assert time.monotonic() < deadline, "a store that raised never completed"
        time.sleep(0.01)
    assert not done[task].is_successful()


def test_storing_present_keys_again_is_not_announced_again(
    adapter: tuple[KVTierL2Adapter, Listener],
) -> None:
    a, listener = adapter
    k = key(301)
    assert store(a, [k], [obj(8)]) >= 0
    assert store(a, [k], [obj(8)]) >= 0
    assert listener.stored == [(k, 8)]
    assert a.get_usage().total_bytes_used == 8


def test_lookup_answers_each_key_not_the_leading_run(
    adapter: tuple[KVTierL2Adapter, Listener],
) -> None:
    a, _ = adapter
    keys = [key(400 + i) for i in range(6)]
    assert store(a, keys[1:4] + keys[5:], [obj(16) for _ in range(4)]) >= 0
    assert lookup(a, keys) == [False, True, True, True, False, True]


def test_the_adapter_declares_the_daemons_capacity_or_the_one_given(daemon: Daemon) -> None:
    a = KVTierL2Adapter({"url": daemon.url})
    try:
        assert a.supports_global_eviction
        assert a.get_usage().total_capacity_bytes == 64 * 2**20  # the test daemon's host tier
    finally:
        a.close()
    b = KVTierL2Adapter({"url": daemon.url, "capacity_bytes": "1MiB"})
    try:
        assert b.get_usage().total_capacity_bytes == 2**20
        assert store(b, [key(501)], [obj(2**18)]) >= 0
        assert b.get_usage().usage_fraction == 0.25
    finally:
        b.close()
    with pytest.raises(ConfigError, match="capacity_bytes"):
        KVTierL2Adapter({"url": daemon.url, "capacity_bytes": "lots"})


def test_close_twice_and_delete_after_close_do_not_raise(daemon: Daemon) -> None:
    a = KVTierL2Adapter({"url": daemon.url})
    listener = Listener()
    a.register_listener(listener)
    a.close()
    a.delete([key(601)])
    a.close()
    assert listener.deleted == []


def test_loads_fill_the_objects_and_tell_lmcache_of_the_hits(
    adapter: tuple[KVTierL2Adapter, Listener], tmp_path: Path
) -> None:
    a, listener = adapter
    k, missing = key(701), key(702)
    assert store(a, [k], [obj(32, fill=7)]) >= 0
    dst, other = obj(32, fill=0), obj(32, fill=0)
    task = a.submit_load_task([k, missing], [dst, other])
    _wait(a.get_load_event_fd())
    bitmap = a.query_load_result(task)
    assert bitmap is not None and [bitmap.test(0), bitmap.test(1)] == [True, False]
    assert bytes(dst.byte_array) == b"\x07" * 32
    assert listener.accessed == [k]
