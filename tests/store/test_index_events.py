"""The store's index events carry keys, and a clean close persists memory-only chunks.

A listener that follows ``INDEXED`` / ``UNINDEXED`` events must end up with exactly the
store's own key set, whatever drops, deletes, demotions and promotions happened (the vLLM
connector's scheduler mirror depends on it). ``close`` moves what only a memory tier
holds into the nvme tier below it, so a restart finds it.
"""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np

from kvtier.config import Switch
from kvtier.keys import ChunkKey
from kvtier.store import StoreEvent, TieredStore
from kvtier.store.policy import PlacementPolicy
from kvtier.tiers.host import HostTier
from kvtier.tiers.host import Options as HostOptions
from kvtier.tiers.nvme import EngineKind
from kvtier.tiers.nvme import Options as NVMeOptions
from kvtier.tiers.nvme.tier import NVMeTier

SLOT = 8192


def key(i: int) -> ChunkKey:
    return ChunkKey(i.to_bytes(16, "little"))


def value(i: int) -> np.ndarray:
    return np.random.default_rng(i + 7).integers(0, 256, SLOT, dtype=np.uint8)


def host(slots: int) -> HostTier:
    return HostTier("host", slots * SLOT, SLOT, 1 << 20, HostOptions(pin=Switch.OFF))


def nvme(d: Path, slots: int) -> NVMeTier:
    return NVMeTier(
        "nvme", slots * SLOT, SLOT, 1 << 20, NVMeOptions(dir=str(d), engine=EngineKind.POSIX)
    )


class DropFromTop(PlacementPolicy):
    """Victims of the top tier are dropped, never demoted (a cache smaller than its use)."""

    def demote_target(self, tier: int, n_tiers: int, keys: object) -> int | None:
        return None


def _follow(store: TieredStore) -> set[bytes]:
    seen: set[bytes] = set(store.keys())

    def on(ev: StoreEvent) -> None:
        if ev.index_change > 0:
            assert not seen & set(ev.keys), "a key entered the index twice"
            seen.update(ev.keys)
        elif ev.index_change < 0:
            assert set(ev.keys) <= seen, "a key left the index it was not in"
            seen.difference_update(ev.keys)

    store.add_listener(on)
    return seen


def test_events_follow_the_index_under_churn(tmp_path: Path) -> None:
    rng = random.Random(0)
    store = TieredStore([host(8), nvme(tmp_path, 24)], io_threads=2)
    mirror = _follow(store)
    for step in range(300):
        i = rng.randrange(60)  # a working set larger than the store (32 slots)
        op = rng.random()
        if op < 0.6:
            store.put([key(i), key(i + 1)], np.concatenate([value(i), value(i + 1)])).result()
        elif op < 0.85:
            out = np.empty(2 * SLOT, np.uint8)
            store.get([key(i), key(i + 1)], out).result()
        else:
            store.delete([key(i)])
        if step % 50 == 0:
            store.drain()
            assert mirror == set(store.keys())
    store.drain()
    assert mirror == set(store.keys())
    assert store.stats().dropped_chunks > 0 and store.stats().demoted_chunks > 0
    store.close()


def test_dropped_victims_leave_the_index_with_their_keys() -> None:
    store = TieredStore([host(4)], io_threads=1, placement=DropFromTop())
    mirror = _follow(store)
    for i in range(10):
        store.put([key(i)], value(i)).result()
    assert mirror == set(store.keys()) == {key(i) for i in range(6, 10)}
    store.close()


def test_clean_close_persists_memory_only_chunks(tmp_path: Path) -> None:
    # Host victims are dropped, so what sits in the host tier at close is there only.
    store = TieredStore([host(8), nvme(tmp_path, 32)], io_threads=2, placement=DropFromTop())
    for i in range(12):
        store.put([key(i)], value(i)).result()
    assert {t for t in store.lookup([key(11)]).tiers} == {"host"}
    assert store.stats().tiers[1].used_bytes == 0  # nothing reached nvme while running
    store.close()

    store = TieredStore([host(8), nvme(tmp_path, 32)], io_threads=2)
    kept = set(store.keys())
    assert kept == {key(i) for i in range(4, 12)}  # the 8 the host tier held
    for i in range(4, 12):
        out = np.empty(SLOT, np.uint8)
        assert store.get([key(i)], out).result().chunks == 1
        assert np.array_equal(out, value(i))
    store.close()


def test_close_keeps_the_hottest_when_nvme_is_smaller(tmp_path: Path) -> None:
    store = TieredStore([host(8), nvme(tmp_path, 4)], io_threads=1, placement=DropFromTop())
    for i in range(8):
        store.put([key(i)], value(i)).result()
    out = np.empty(SLOT, np.uint8)
    store.get([key(0)], out).result()  # 0 is now the most recently used
    store.close()
    store = TieredStore([host(8), nvme(tmp_path, 4)], io_threads=1)
    assert set(store.keys()) == {key(0), key(5), key(6), key(7)}
    store.close()


_EXIT_CHILD = """
import atexit, sys
import numpy as np
from tests.store.test_index_events import DropFromTop, host, key, nvme, value
from kvtier.store import TieredStore
from pathlib import Path

store = TieredStore([host(8), nvme(Path(sys.argv[1]), 32)], io_threads=2, placement=DropFromTop())
for i in range(6):
    store.put([key(i)], value(i)).result()
# Closed by an exit hook, as vLLM's engine finalizer closes the connector: by then the
# interpreter's thread pools take no new work.
atexit.register(store.close)
"""


def test_close_from_an_exit_hook_still_persists(tmp_path: Path) -> None:
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[2]
    r = subprocess.run(
        [sys.executable, "-c", _EXIT_CHILD, str(tmp_path)],
        cwd=root,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    assert "Traceback" not in r.stderr, r.stderr
    store = TieredStore([host(8), nvme(tmp_path, 32)], io_threads=1)
    try:
        assert set(store.keys()) == {key(i) for i in range(6)}
        out = np.empty(6 * SLOT, np.uint8)
        assert store.get([key(i) for i in range(6)], out).result().chunks == 6
        assert np.array_equal(out, np.concatenate([value(i) for i in range(6)]))
    finally:
        store.close()
