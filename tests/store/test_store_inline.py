"""``TieredStore(io_threads=0)``: operations run on the caller's thread, same outcomes."""

from __future__ import annotations

import threading

import numpy as np

from kvtier.config import Switch
from kvtier.keys import ChunkKey
from kvtier.store import TieredStore
from kvtier.tiers.base import TierGeometry
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
