"""How the mover moves bytes: straight from a tier of plain memory, else through staging."""

from __future__ import annotations

import numpy as np

from kvtier.config import Switch
from kvtier.keys import ChunkKey
from kvtier.store import TieredStore
from kvtier.tiers.base import SlotRun, TierGeometry
from kvtier.tiers.host import HostTier, Options

SLOT = 8192


def key(i: int) -> ChunkKey:
    return ChunkKey(i.to_bytes(16, "little"))


def rand(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, size=n, dtype=np.uint8)


def geometry(name: str, slots: int) -> TierGeometry:
    return TierGeometry(name, slots * SLOT, SLOT, 1 << 20)


class Recording(HostTier):
    """A lower tier that notes the address of every buffer it is written from."""

    def __init__(self, name: str, slots: int) -> None:
        super().__init__(geometry(name, slots), Options(pin=Switch.OFF))
        self.sources: list[tuple[int, int]] = []  # (address, bytes)

    def _write(self, run: SlotRun, src: memoryview) -> None:
        arr = np.frombuffer(src, dtype=np.uint8)
        self.sources.append((arr.ctypes.data, arr.nbytes))
        super()._write(run, src)


class NoViews(HostTier):
    """A tier of memory that gives no views, as a tier behind I/O does."""

    def slot_view(self, offset: int, nbytes: int) -> memoryview | None:
        return None


def within(arena: HostTier, address: int, nbytes: int) -> bool:
    base = arena.arena.array.ctypes.data
    return base <= address and address + nbytes <= base + arena.arena.array.nbytes


def test_a_demotion_writes_straight_from_the_upper_tiers_slots() -> None:
    top = HostTier(geometry("top", 8), Options(pin=Switch.OFF))
    low = Recording("low", 32)
    with TieredStore([top, low], io_threads=1) as store:
        a, b = [key(i) for i in range(8)], [key(100 + i) for i in range(8)]
        da, db = rand(8 * SLOT, 1), rand(8 * SLOT, 2)
        store.put(a, da).result()
        reads = top.stats().bytes_read
        store.put(b, db).result()  # the top tier is full: a's chunks move down
        assert set(store.lookup(a).tiers) == {"low"}
        assert low.sources and all(within(top, at, n) for at, n in low.sources)
        assert top.stats().bytes_read - reads == 8 * SLOT  # counted as the tier's reads
        out = np.zeros_like(da)
        assert store.get(a, out).result().chunks == 8 and np.array_equal(out, da)
        assert store.get(b, out).result().chunks == 8 and np.array_equal(out, db)


def test_scattered_victims_move_one_by_one_from_their_slots_with_the_right_bytes() -> None:
    top = HostTier(geometry("top", 8), Options(pin=Switch.OFF))
    low = Recording("low", 32)
    with TieredStore([top, low], io_threads=1) as store:
        values = {i: rand(SLOT, 10 + i) for i in range(8)}
        for i in range(8):  # one put each: eight separate sequences
            store.put([key(i)], values[i]).result()
        out = np.zeros(SLOT, np.uint8)
        for i in (1, 3, 5, 7):  # touched: the odd ones are now the most recently used
            assert store.get([key(i)], out).result().chunks == 1
        fresh = rand(4 * SLOT, 99)
        store.put([key(50 + j) for j in range(4)], fresh).result()
        moved = [i for i in range(8) if store.lookup([key(i)]).tiers == ("low",)]
        assert moved and all(i % 2 == 0 for i in moved)  # slots 0, 2, 4, 6: not adjacent
        assert all(within(top, at, n) for at, n in low.sources)
        for i in range(8):
            assert store.get([key(i)], out).result().chunks == 1
            assert np.array_equal(out, values[i]), i
        back = np.zeros_like(fresh)
        got = store.get([key(50 + j) for j in range(4)], back).result()
        assert got.chunks == 4 and np.array_equal(back, fresh)


class RecordingNoViews(Recording):
    def slot_view(self, offset: int, nbytes: int) -> memoryview | None:
        return None


def test_between_tiers_without_views_the_bytes_are_staged() -> None:
    top = NoViews(geometry("top", 8), Options(pin=Switch.OFF))
    low = RecordingNoViews("low", 32)
    with TieredStore([top, low], io_threads=1) as store:
        a, b = [key(i) for i in range(8)], [key(100 + i) for i in range(8)]
        da, db = rand(8 * SLOT, 3), rand(8 * SLOT, 4)
        store.put(a, da).result()
        store.put(b, db).result()
        assert set(store.lookup(a).tiers) == {"low"}
        assert low.sources and not any(within(top, at, n) for at, n in low.sources)
        out = np.zeros_like(da)
        assert store.get(a, out).result().chunks == 8 and np.array_equal(out, da)


class BehindIO(NoViews):
    """A lower tier without views (as nvme) that notes where every read lands."""

    def __init__(self, name: str, slots: int) -> None:
        super().__init__(geometry(name, slots), Options(pin=Switch.OFF))
        self.landed: list[tuple[int, int]] = []  # (address, bytes)

    def _read(self, run: SlotRun, dst: memoryview) -> None:
        arr = np.frombuffer(dst, dtype=np.uint8)
        self.landed.append((arr.ctypes.data, arr.nbytes))
        super()._read(run, dst)


def test_a_promotion_reads_straight_into_the_new_slots() -> None:
    top = HostTier(geometry("top", 8), Options(pin=Switch.OFF))
    low = BehindIO("low", 32)
    with TieredStore([top, low], io_threads=1, promote_on_hit=True) as store:
        a, b = [key(i) for i in range(8)], [key(100 + i) for i in range(8)]
        da, db = rand(8 * SLOT, 5), rand(8 * SLOT, 6)
        store.put(a, da).result()
        store.put(b, db).result()  # a moves down (staged: the lower tier gives no views)
        written = top.stats().bytes_written
        out = np.zeros_like(da)
        assert store.get(a, out).result().chunks == 8 and np.array_equal(out, da)
        store.drain()  # the promotion runs after the get
        promoted = [i for i, k in enumerate(a) if store.lookup([k]).tiers == ("top",)]
        assert promoted  # some of a came back up
        into_top = [(at, n) for at, n in low.landed if within(top, at, n)]
        assert sum(n for _, n in into_top) == len(promoted) * SLOT  # no staging between
        assert top.stats().bytes_written - written >= len(promoted) * SLOT  # counted
        for k, i in ((a[i], i) for i in range(8)):
            got = np.zeros(SLOT, np.uint8)
            assert store.get([k], got).result().chunks == 1
            assert np.array_equal(got, da[i * SLOT : (i + 1) * SLOT]), i
