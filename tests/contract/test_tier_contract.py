"""The contract every tier honours, run over every kind in ``TIER_FACTORIES``."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from kvtier.config import Switch
from kvtier.errors import InputError
from kvtier.keys import ChunkKey
from kvtier.store import TieredStore
from kvtier.tiers.base import SlotRun, Tier, TierGeometry, ViewableTier
from kvtier.tiers.host import HostTier, Options
from tests.contract.tiers import TIER_FACTORIES

SLOT = 16 * 1024
CAP = 64 * SLOT


def key(i: int) -> ChunkKey:
    return ChunkKey(i.to_bytes(16, "little"))


@pytest.fixture(params=sorted(TIER_FACTORIES))
def make_tier(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[object]:
    made: list[Tier] = []

    def make(slot: int = SLOT, cap: int = CAP) -> Tier:
        t = TIER_FACTORIES[request.param](tmp_path, slot, cap)
        made.append(t)
        return t

    yield make
    for t in made:
        t.close()


def gives_views(tier: Tier) -> bool:
    """Whether the tier offers in-place views (by type) and this instance gives them."""
    return isinstance(tier, ViewableTier) and tier.slot_view(0, SLOT - 100) is not None


def rand(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, size=n, dtype=np.uint8)


def test_roundtrip_full_slots(make_tier) -> None:
    tier = make_tier()
    exts = tier.allocate(7)
    assert exts is not None and sum(e.units for e in exts) == 7
    for i, e in enumerate(exts):
        run = SlotRun(e.offset, tuple(key(i * 100 + j) for j in range(e.units)), SLOT)
        data = rand(run.nbytes, seed=i)
        tier.write(run, memoryview(data))
        out = np.zeros_like(data)
        tier.read(run, memoryview(out))
        assert np.array_equal(out, data)


def test_roundtrip_short_values(make_tier) -> None:
    tier = make_tier()
    (e,) = tier.allocate(4)
    run = SlotRun(e.offset, tuple(key(j) for j in range(4)), 1000)
    data = rand(run.nbytes, seed=3)
    tier.write(run, memoryview(data))
    out = np.zeros_like(data)
    tier.read(run, memoryview(out))
    assert np.array_equal(out, data)
    # Reading a sub-run of the same extent sees the same bytes.
    sub = SlotRun(e.offset + 1, run.keys[1:3], 1000)
    part = np.zeros(sub.nbytes, dtype=np.uint8)
    tier.read(sub, memoryview(part))
    assert np.array_equal(part, data[1000:3000])


def test_capacity_is_bounded_and_reusable(make_tier) -> None:
    tier = make_tier()
    assert tier.capacity_slots == CAP // tier.slot_bytes
    exts = tier.allocate(tier.capacity_slots)
    assert exts is not None
    assert tier.free_slots == 0
    assert tier.allocate(1) is None
    for e in exts:
        tier.release(e.offset, e.units)
    assert tier.free_slots == tier.capacity_slots
    assert tier.allocate(tier.capacity_slots) is not None


def test_release_one_slot_of_an_extent(make_tier) -> None:
    tier = make_tier()
    (e,) = tier.allocate(8)
    tier.release(e.offset + 3, 1)
    assert tier.free_slots == tier.capacity_slots - 7
    with pytest.raises(InputError):
        tier.release(e.offset + 3, 1)  # double free is refused
    tier.release(e.offset, 3)
    tier.release(e.offset + 4, 4)
    assert tier.free_slots == tier.capacity_slots


def test_wrong_buffer_size_is_refused(make_tier) -> None:
    tier = make_tier()
    (e,) = tier.allocate(1)
    run = SlotRun(e.offset, (key(1),), SLOT)
    with pytest.raises(InputError):
        tier.write(run, memoryview(bytes(SLOT - 1)))
    with pytest.raises(InputError):
        tier.write(
            SlotRun(e.offset, (key(1),), tier.slot_bytes + 1),
            memoryview(bytes(tier.slot_bytes + 1)),
        )


def test_concurrent_disjoint_writes(make_tier) -> None:
    tier = make_tier()
    runs = []
    for i in range(8):
        (e,) = tier.allocate(4)
        runs.append(
            (SlotRun(e.offset, tuple(key(i * 10 + j) for j in range(4)), SLOT), rand(4 * SLOT, i))
        )
    threads = [threading.Thread(target=tier.write, args=(r, memoryview(d))) for r, d in runs]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for r, d in runs:
        out = np.zeros_like(d)
        tier.read(r, memoryview(out))
        assert np.array_equal(out, d)


def test_stats_count_bytes(make_tier) -> None:
    tier = make_tier()
    (e,) = tier.allocate(2)
    run = SlotRun(e.offset, (key(1), key(2)), SLOT)
    tier.write(run, memoryview(rand(run.nbytes)))
    tier.read(run, memoryview(np.zeros(run.nbytes, np.uint8)))
    st = tier.stats()
    assert st.bytes_written >= run.nbytes and st.bytes_read >= run.nbytes
    assert st.used_bytes == 2 * tier.slot_bytes
    assert st.capacity_bytes == tier.capacity_bytes


def test_close_is_idempotent(make_tier) -> None:
    tier = make_tier()
    tier.close()
    tier.close()


def test_store_over_tier_as_only_tier(make_tier) -> None:
    tier = make_tier()
    with TieredStore([tier], io_threads=2) as store:
        keys = [key(i) for i in range(20)]
        data = rand(20 * SLOT, 5)
        assert store.put(keys, data).result().stored == 20
        assert store.lookup(keys).hits == 20
        out = np.zeros_like(data)
        r = store.get(keys, out).result()
        assert r.chunks == 20 and np.array_equal(out, data)
        assert store.delete(keys[10:]) == 10
        assert store.lookup(keys).hits == 10


def test_store_demotes_into_tier_intact(make_tier) -> None:
    lower = make_tier()
    top = HostTier(TierGeometry("top", 8 * SLOT, SLOT, 1 << 30), Options(pin=Switch.OFF))
    with TieredStore([top, lower], io_threads=2, promote_on_hit=False) as store:
        keys = [key(i) for i in range(40)]
        data = rand(40 * SLOT, 6)
        for i in range(0, 40, 8):  # five sequences of 8 chunks; older ones get demoted
            assert store.put(keys[i : i + 8], data[i * SLOT : (i + 8) * SLOT]).result().stored == 8
        where = store.lookup(keys).tiers
        assert len(where) == 40
        assert set(where) == {"top", lower.name}
        out = np.zeros_like(data)
        r = store.get(keys, out).result()
        assert r.chunks == 40
        assert np.array_equal(out, data)
        assert store.stats().demoted_chunks >= 32


def test_run_view_is_the_packed_values_in_place_or_absent(make_tier) -> None:
    # The mover writes a moving run from this view: it must be exactly the run's packed
    # values, and absent wherever the slots' bytes are not (padding between short values).
    tier = make_tier()
    (ext,) = tier.allocate(4) or []
    full = SlotRun(ext.offset, tuple(key(i) for i in range(4)), SLOT)
    data = rand(full.nbytes, 3)
    tier.write(full, memoryview(data))
    if not gives_views(tier):
        assert not isinstance(tier, ViewableTier) or tier.run_view(full) is None
        return
    assert isinstance(tier, ViewableTier)
    view = tier.run_view(full)
    assert view is not None and bytes(view) == data.tobytes()
    one = SlotRun(ext.offset, (key(0),), SLOT - 100)
    tier.write(one, memoryview(data[: SLOT - 100]))
    assert bytes(tier.run_view(one) or b"") == data[: SLOT - 100].tobytes()
    padded = SlotRun(ext.offset, (key(0), key(1)), SLOT - 100)
    assert tier.run_view(padded) is None  # slot padding lies between the values


def test_slot_view_fills_in_place_or_is_absent(make_tier) -> None:
    # A tier either gives a view that a store can fill and read back through read(),
    # or none (the store then writes through write()): reserve() follows that.
    tier = make_tier()
    store = TieredStore([tier], io_threads=1)
    data = rand(SLOT - 100, 7)
    res = store.reserve(key(1), data.nbytes)
    if not gives_views(tier):
        assert res is None
        store.close()
        return
    assert res is not None and res.view.nbytes == data.nbytes and not res.view.readonly
    res.view[:] = data.tobytes()
    assert store.lookup([key(1)]).hits == 0  # not indexed before the commit
    before = tier.stats().bytes_written
    assert res.commit().stored == 1
    assert tier.stats().bytes_written == before + data.nbytes
    out = np.zeros(SLOT, np.uint8)
    got = store.get([key(1)], out).result()
    assert got.nbytes == data.nbytes and np.array_equal(out[: data.nbytes], data)
    store.close()
