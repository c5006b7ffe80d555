"""TieredStore.reserve: a put filled in place by its caller (the daemon's body reads)."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from concurrent.futures import wait
from pathlib import Path

import numpy as np
import pytest

from kvtier.config import Switch
from kvtier.errors import ClosedError, InputError
from kvtier.keys import ChunkKey
from kvtier.store import EventKind, StoreEvent, TieredStore
from kvtier.tiers.base import TierGeometry
from kvtier.tiers.cxl import CXLTier
from kvtier.tiers.cxl import Options as CXLOptions
from kvtier.tiers.host import HostTier, Options
from kvtier.tiers.nvme import EngineKind
from kvtier.tiers.nvme import Options as NVMeOptions
from kvtier.tiers.nvme.tier import NVMeTier

SLOT = 8192


def key(i: int) -> ChunkKey:
    return ChunkKey(i.to_bytes(16, "little"))


def host(name: str, slots: int) -> HostTier:
    return HostTier(
        TierGeometry(name, slots * SLOT, SLOT, 1 << 20), Options(pin=Switch.OFF, prefault=False)
    )


def rand(n: int, seed: int = 0) -> bytes:
    return np.random.default_rng(seed).integers(0, 256, size=n, dtype=np.uint8).tobytes()


@pytest.fixture
def store() -> Iterator[TieredStore]:
    s = TieredStore([host("top", 4), host("low", 8)], io_threads=2)
    yield s
    s.close()


def read(store: TieredStore, k: ChunkKey) -> bytes | None:
    out = bytearray(SLOT)
    r = store.get([k], out).result()
    return bytes(out[: r.nbytes]) if r.chunks else None


def test_commit_stores_what_the_view_holds(store: TieredStore) -> None:
    events: list[StoreEvent] = []
    store.add_listener(events.append)
    value = rand(5000, 1)
    res = store.reserve(key(1), len(value))
    assert res is not None and res.view.nbytes == len(value)
    res.view[:1000] = value[:1000]  # filled piece by piece, as a body arrives
    res.view[1000:] = value[1000:]
    # Pending: not found, and a put of the same key meanwhile counts it present.
    assert store.lookup([key(1)]).hits == 0
    assert store.put([key(1)], rand(5000, 2)).result().present == 1
    assert res.commit().stored == 1
    assert read(store, key(1)) == value
    assert store.lookup([key(1)]).tiers == ("top",)
    st = store.stats()
    assert st.put_chunks == 1 and st.chunks == 1
    assert any(e.kind is EventKind.STORED and e.nbytes == len(value) for e in events)
    assert res.commit().stored == 0  # a second commit changes nothing


def test_present_key_is_not_reserved(store: TieredStore) -> None:
    store.put([key(1)], rand(SLOT)).result()
    assert store.reserve(key(1), SLOT) is None
    res = store.reserve(key(2), SLOT)
    assert res is not None
    assert store.reserve(key(2), SLOT) is None  # being put
    res.abort()


def test_abort_frees_the_slot_and_the_key(store: TieredStore) -> None:
    held = [store.reserve(key(i), SLOT) for i in range(4)]
    assert all(r is not None for r in held)
    assert store.reserve(key(9), SLOT) is None  # the top tier has no free slot left
    for r in held:
        assert r is not None
        r.abort()
    assert store.lookup([key(0)]).hits == 0
    again = store.reserve(key(0), SLOT)
    assert again is not None
    again.view[:] = rand(SLOT, 3)
    again.commit()
    assert read(store, key(0)) == rand(SLOT, 3)
    assert store.stats().put_chunks == 1


def test_full_top_tier_falls_back_to_put(store: TieredStore) -> None:
    for i in range(4):
        store.put([key(i)], rand(SLOT, i)).result()
    assert store.reserve(key(10), SLOT) is None  # making room would move chunks
    assert store.put([key(10)], rand(SLOT, 10)).result().stored == 1
    assert read(store, key(10)) == rand(SLOT, 10)


def test_tiers_without_views_are_not_reserved(tmp_path: Path) -> None:
    nvme = NVMeTier(
        TierGeometry("nvme", 8 * SLOT, SLOT, 1 << 20),
        NVMeOptions(dir=str(tmp_path), engine=EngineKind.POSIX),
    )
    cxl = CXLTier(
        TierGeometry("cxl", 8 * SLOT, SLOT, 1 << 20),
        CXLOptions(emulate=Switch.ON, latency_us=1.0, bandwidth_gbps=200.0, pin=Switch.OFF),
    )
    for top in (nvme, cxl):
        with TieredStore([top], io_threads=1) as s:
            assert s.reserve(key(1), SLOT) is None
            assert s.put([key(1)], rand(SLOT)).result().stored == 1  # the claim was given back


def test_bad_sizes_and_closed_store(store: TieredStore) -> None:
    with pytest.raises(InputError):
        store.reserve(key(1), 0)
    with pytest.raises(InputError):
        store.reserve(key(1), SLOT + 1)
    store.close()
    with pytest.raises(ClosedError):
        store.reserve(key(1), 16)


def test_close_waits_for_open_reservations_to_end(store: TieredStore) -> None:
    res = store.reserve(key(1), SLOT)
    assert res is not None
    closed = threading.Event()
    t = threading.Thread(target=lambda: (store.close(), closed.set()))
    t.start()
    assert not closed.wait(0.2)
    res.view[:] = rand(SLOT, 5)
    res.commit()
    t.join(10)
    assert closed.is_set()


def test_gets_of_memory_hits_run_on_the_callers_thread(tmp_path: Path) -> None:
    readers: list[str] = []

    class Disk(NVMeTier):
        def _read(self, run, dst):  # type: ignore[no-untyped-def]
            readers.append(threading.current_thread().name)
            super()._read(run, dst)

    disk = Disk(
        TierGeometry("nvme", 8 * SLOT, SLOT, 1 << 20),
        NVMeOptions(dir=str(tmp_path), engine=EngineKind.POSIX),
    )
    with TieredStore([host("top", 1), disk], io_threads=1, promote_on_hit=False) as s:
        s.put([key(1)], rand(SLOT, 1)).result()
        s.put([key(2)], rand(SLOT, 2)).result()  # key(1) goes down to the disk
        assert s.lookup([key(1), key(2)]).tiers == ("nvme", "top")
        out = bytearray(SLOT)
        hit = s.get([key(2)], out, inline_memory_bytes=SLOT)
        assert hit.done() and hit.result().chunks == 1 and bytes(out) == rand(SLOT, 2)
        assert s.get([key(3)], out, inline_memory_bytes=SLOT).done()  # a miss: nothing to do
        # A read from a tier behind I/O stays on the I/O threads: waited for as the
        # daemon's event loop does, without result(), which would run it here.
        fut = s.get([key(1)], out, inline_memory_bytes=SLOT)
        wait([fut], timeout=10)
        assert fut.result().chunks == 1
        assert bytes(out) == rand(SLOT, 1)
        assert readers and all(name.startswith("kvtier-io") for name in readers)
