"""``TieredStore(io_threads=0)``: operations run on the caller's thread, same outcomes."""

from __future__ import annotations

import threading

import numpy as np

from kvtier.config import Switch
from kvtier.keys import ChunkKey
from kvtier.store import TieredStore
from kvtier.store.store import INLINE_MEMORY_GET_BYTES
from kvtier.tiers.base import SlotRun, TierGeometry
from kvtier.tiers.host import HostTier, Options

VALUE = 4096


def key(i: int) -> ChunkKey:
    return ChunkKey(i.to_bytes(16, "little"))


def run(io_threads: int) -> tuple[list[int], tuple[tuple[str, int], ...], set[str]]:
    threads: set[str] = set()
    tiers = [
        HostTier(TierGeometry("a", 4 * VALUE, VALUE, 1 << 20), Options(pin=Switch.OFF)),
        HostTier(TierGeometry("b", 8 * VALUE, VALUE, 1 << 20), Options(pin=Switch.OFF)),
    ]
    hits = []
    with TieredStore(tiers, io_threads=io_threads) as store:
        store.add_listener(lambda ev: threads.add(threading.current_thread().name))
        for r in range(12):
            keys = [key(r % 3), key(100 + r)]
            n = store.lookup(keys).hits
            hits.append(n)
            if n:
                dst = np.empty(n * VALUE, np.uint8)
                fut = store.get(keys[:n], dst)
                assert fut.result().chunks == n
                assert dst[0] == (r % 3)  # the value stored for key(r % 3)
            if n < 2:
                data = np.concatenate(
                    [np.full(VALUE, r % 3, np.uint8), np.full(VALUE, 7, np.uint8)]
                )[n * VALUE :]
                store.put(keys[n:], data).result()
            store.drain()
        tier_hits = store.stats().tier_hits
    return hits, tier_hits, threads


def test_inline_store_matches_the_pooled_store_on_the_callers_thread() -> None:
    inline = run(0)
    pooled = run(1)
    assert inline[:2] == pooled[:2]
    assert inline[2] == {threading.current_thread().name}
    # A pooled store runs what its caller waits for on the caller's thread (the executor
    # lets a waiter take its own unstarted task), the rest on its I/O threads.
    caller = threading.current_thread().name
    assert all(name.startswith("kvtier-io") or name == caller for name in pooled[2])


class _SlowMemory(HostTier):
    """A host tier that records which thread reads it, and offers no views: to the store
    it is a tier behind I/O, whose reads never run on the caller's thread by default."""

    readers: set[str]

    def slot_view(self, offset: int, nbytes: int) -> memoryview | None:
        return None

    def _read(self, run: SlotRun, dst: memoryview) -> None:
        self.readers.add(threading.current_thread().name)
        super()._read(run, dst)


def test_a_small_memory_hit_is_copied_on_the_callers_thread_by_default() -> None:
    small = INLINE_MEMORY_GET_BYTES // 2
    tier = HostTier(TierGeometry("a", 4 * small, small, 4 * small), Options(pin=Switch.OFF))
    with TieredStore([tier], io_threads=1) as store:
        store.put([key(1)], np.full(small, 5, np.uint8)).result()
        dst = np.zeros(small, np.uint8)
        fut = store.get([key(1)], dst)
        assert fut.done()  # copied before get() returned: no hand-off to wait for
        assert fut.result().chunks == 1 and (dst == 5).all()
        # The caller may still ask for the I/O thread.
        assert store.get([key(1)], dst, inline_memory_bytes=0).result().chunks == 1


def test_a_tier_behind_io_is_never_read_on_the_callers_thread_by_default() -> None:
    tier = _SlowMemory(TierGeometry("a", 4 * VALUE, VALUE, 4 * VALUE), Options(pin=Switch.OFF))
    tier.readers = set()
    with TieredStore([tier], io_threads=1) as store:
        store.put([key(1)], np.full(VALUE, 5, np.uint8)).result()
        dst = np.zeros(VALUE, np.uint8)
        done = threading.Event()
        fut = store.get([key(1)], dst)
        fut.add_done_callback(lambda _: done.set())  # not a waiter: the I/O thread reads
        assert done.wait(10)
        assert fut.result().chunks == 1 and (dst == 5).all()
    assert threading.current_thread().name not in tier.readers
