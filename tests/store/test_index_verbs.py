"""The index's two-phase verbs, through its public face alone.

The mover and the store change the books only through these (prepare, then complete or
cancel), so their promises are checked here on the index itself: what a prepared
operation hides or claims, what cancelling leaves, and that eviction is atomic.
"""

from __future__ import annotations

import pytest

from kvtier.keys import ChunkKey
from kvtier.store.index import Eviction, Room, StoreIndex
from kvtier.store.native import NativeStoreIndex, make_index
from kvtier.store.policy import LRUEviction, WriteThrough
from kvtier.store.types import EventKind, StoreEvent
from kvtier.tiers.base import TierGeometry
from kvtier.tiers.meta import MetaTier

SLOT = 4096
NATIVE = [False]


@pytest.fixture(
    autouse=True,
    params=[
        pytest.param(False, id="reference"),
        pytest.param(
            True,
            id="native",
            marks=pytest.mark.skipif(NativeStoreIndex is None, reason="C core not built"),
        ),
    ],
)
def implementation(request: pytest.FixtureRequest) -> None:
    NATIVE[0] = request.param


def key(i: int) -> ChunkKey:
    return ChunkKey(i.to_bytes(16, "little"))


def index(*slots: int) -> tuple[StoreIndex, list[StoreEvent]]:
    tiers = [MetaTier(TierGeometry(f"t{i}", n * SLOT, SLOT, 1 << 20)) for i, n in enumerate(slots)]
    events: list[StoreEvent] = []
    ix = make_index(tiers, LRUEviction, WriteThrough(), events.append, native=NATIVE[0])
    return ix, events


def store(ix: StoreIndex, t: int, keys: list[ChunkKey]) -> None:
    """What the mover does for a put into tier ``t``."""
    claimed = ix.prepare_store(keys)
    extents = ix.tiers[t].allocate(len(claimed))
    assert extents is not None
    offsets = [o for e in extents for o in range(e.offset, e.offset + e.units)]
    ix.add_stored(t, [(k, o) for (_, k), o in zip(claimed, offsets, strict=True)], SLOT)
    ix.complete_store(claimed, len(claimed), 0)


def test_a_prepared_store_is_present_to_other_puts_and_absent_to_readers() -> None:
    ix, _ = index(4)
    claimed = ix.prepare_store([key(1), key(2), key(1)])
    assert [k for _, k in claimed] == [key(1), key(2)]  # a key twice is stored once
    assert ix.prepare_store([key(2), key(3)]) == [(1, key(3))]  # key 2 is being put
    assert ix.present_run([key(1)]) == []
    assert not ix.prepare_store_one(key(1))
    ix.complete_store(claimed, 0, 0)  # nothing was written: both rejected
    assert ix.prepare_store_one(key(1))
    ix.cancel_store_one(key(1))
    st = ix.stats()
    assert (st.puts, st.put_present, st.put_rejected, st.put_chunks) == (2, 2, 2, 0)


def test_a_cancelled_load_counts_nothing_and_a_completed_one_counts_its_hits() -> None:
    ix, _ = index(4)
    store(ix, 0, [key(1), key(2)])
    ix.cancel_load(ix.prepare_load([key(1), key(2)]))
    assert ix.stats().gets == 0
    slots = ix.prepare_load([key(1), key(2), key(3)])
    assert [sl.key for sl in slots] == [key(1), key(2)]
    assert ix.complete_load(slots, 1, SLOT, promote=True) == []  # a top-tier hit
    st = ix.stats()
    assert (st.gets, st.get_chunks, st.get_bytes, st.tier_hits) == (1, 1, SLOT, (("t0", 1),))


def test_eviction_claims_exactly_the_missing_slots_or_changes_nothing() -> None:
    ix, events = index(4, 8)
    store(ix, 0, [key(i) for i in range(4)])
    assert ix.prepare_eviction(0, 0) is Room.FREE
    ix.pin([key(0), key(1), key(2)])
    before = ix.evictable_slots(0)
    assert ix.prepare_eviction(0, 2) is Room.SHORT  # one chunk is evictable, two needed
    assert ix.evictable_slots(0) == before  # nothing claimed, nothing dropped
    assert sorted(ix.keys()) == sorted(key(i) for i in range(4))
    ix.unpin([key(0), key(1), key(2)])
    ev = ix.prepare_eviction(0, 2)
    assert isinstance(ev, Eviction) and ev.target == 1
    assert [v.key for v in ev.victims] == [key(3), key(2)]  # the tail goes first
    assert ix.prepare_move([key(3)], range(2)) == []  # claimed: no second mover
    ix.cancel_move(list(ev.victims))
    assert ix.evictable_slots(0) == 4
    assert not [e for e in events if e.kind is EventKind.UNINDEXED]


def test_a_completed_move_repoints_and_counts_its_direction() -> None:
    ix, _ = index(4, 8)
    store(ix, 0, [key(1), key(2)])
    claimed = ix.prepare_move([key(1), key(2)], range(1))
    extents = ix.tiers[1].allocate(2)
    assert extents is not None
    landed = [
        ix.new_slot(sl.key, 1, extents[0].offset + j, sl.value_bytes)
        for j, sl in enumerate(claimed)
    ]
    free_below = ix.tiers[1].free_slots
    # The second copy failed: that chunk stays where it was, its landing slot goes back.
    assert ix.complete_move(claimed, landed, [True, False], drop=False) == 1
    assert ix.tiers[1].free_slots == free_below + 1
    assert [sl.tier for sl in ix.present_run([key(1), key(2)])] == [1, 0]
    assert (ix.stats().demoted_chunks, ix.stats().promoted_chunks) == (1, 0)
