"""The native index (kvtier/_core_index.c) agrees with the Python reference, verb by verb.

Two indexes over equal tiers get the same random sequence of the verbs the mover and
the store call (puts, gets, deletes, pins, touches, evictions and moves, lookups); every
answer, every event, every release to a tier, the eviction order and the counters must be
the same. A slot is compared by what it says (key, tier, offset, length, readers,
retired): the two indexes build slot records of different classes.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from kvtier.keys import ChunkKey
from kvtier.store.index import Eviction, Room, StoreIndex
from kvtier.store.native import NativeStoreIndex, make_index
from kvtier.store.policy import LRUEviction, PlacementPolicy
from kvtier.store.quota import Quotas
from kvtier.store.types import StoreEvent
from kvtier.tiers.base import TierGeometry
from kvtier.tiers.meta import MetaTier

pytestmark = pytest.mark.skipif(NativeStoreIndex is None, reason="C core not built")

SLOT = 4096


def key(i: int) -> ChunkKey:
    return ChunkKey(i.to_bytes(16, "little"))


class Recording(PlacementPolicy):
    """A placement that overrides every hook and records its calls (on_hit included, so
    the native verbs call it), promoting only from odd tiers' even-sized batches."""

    def __init__(self) -> None:
        self.calls: list[tuple[Any, ...]] = []

    def on_hit(self, tier: int, keys: Sequence[ChunkKey]) -> None:
        self.calls.append(("hit", tier, tuple(keys)))

    def on_miss(self, keys: Sequence[ChunkKey]) -> None:
        self.calls.append(("miss", tuple(keys)))

    def should_promote(self, tier: int, keys: Sequence[ChunkKey]) -> bool:
        self.calls.append(("promote?", tier, tuple(keys)))
        return len(keys) % 2 == 0


def view(slot: Any) -> tuple[Any, ...]:
    return (slot.key, slot.tier, slot.offset, slot.value_bytes, slot.readers, slot.retired)


def project(x: Any) -> Any:
    """A verb's answer with slots replaced by what they say."""
    if hasattr(x, "readers") and hasattr(x, "retired"):
        return view(x)
    if isinstance(x, Eviction):
        return ("eviction", tuple(view(v) for v in x.victims), x.target)
    if isinstance(x, list | tuple):
        return type(x)(project(v) for v in x)
    return x


class Side:
    """One index with its own tiers, placement and event log."""

    def __init__(self, native: bool, slots: tuple[int, int], quotas: Quotas | None) -> None:
        self.tiers = [
            MetaTier(TierGeometry(f"t{i}", n * SLOT, SLOT, 8 * SLOT)) for i, n in enumerate(slots)
        ]
        self.placement = Recording()
        self.events: list[StoreEvent] = []
        self.ix: StoreIndex = make_index(
            self.tiers, LRUEviction, self.placement, self.events.append, quotas, native=native
        )
        # Holds the driver took and must give back, by hold id (the same on both sides).
        self.holds: dict[int, list[Any]] = {}


class Lockstep(RuleBasedStateMachine):
    quotas: Quotas | None = None

    @initialize(top=st.integers(2, 12), low=st.integers(2, 24))
    def setup(self, top: int, low: int) -> None:
        self.ref = Side(False, (top, low), self.quotas)
        self.nat = Side(True, (top, low), self.quotas)
        assert type(self.nat.ix) is NativeStoreIndex
        self.next_hold = 0

    def both(self, fn: Any) -> Any:
        """Run ``fn(side)`` on both; answers (or errors) must agree."""
        out = []
        for side in (self.ref, self.nat):
            try:
                out.append(("ok", project(fn(side))))
            except Exception as exc:  # the same refusal on both sides
                out.append(("error", type(exc).__name__, str(exc)))
        assert out[0] == out[1]
        return out[0]

    @rule(
        first=st.integers(0, 30), n=st.integers(1, 6), t=st.integers(0, 1), fail=st.integers(0, 2)
    )
    def put(self, first: int, n: int, t: int, fail: int) -> None:
        keys = [key(i) for i in range(first, first + n)] + [key(first)]  # a key twice

        def go(s: Side) -> Any:
            claimed = s.ix.prepare_store(keys)
            ext = s.ix.tiers[t].allocate(len(claimed)) if claimed else None
            stored = 0
            if ext is not None:
                offsets = [o for e in ext for o in range(e.offset, e.offset + e.units)]
                keep = max(0, len(claimed) - fail)  # the last `fail` copies failed
                for o in offsets[keep:]:
                    s.ix.tiers[t].release(o, 1)
                written = [(k, o) for (_, k), o in zip(claimed[:keep], offsets, strict=False)]
                s.ix.add_stored(t, written, SLOT - 64)
                stored = len(written)
            failed = len(claimed) - stored if ext is not None else 0
            s.ix.complete_store(claimed, stored, failed)
            return claimed, stored

        self.both(go)

    @rule(first=st.integers(0, 30), n=st.integers(1, 6), hold=st.booleans(), promote=st.booleans())
    def get(self, first: int, n: int, hold: bool, promote: bool) -> None:
        keys = [key(i) for i in range(first, first + n)]
        hid = self.next_hold
        self.next_hold += 1

        def go(s: Side) -> Any:
            slots = s.ix.prepare_load(keys)
            if hold:  # finished later (or never), as a slow reader
                s.holds[hid] = slots
                return slots
            served = len(slots) // 2 + 1 if slots else 0
            return slots, s.ix.complete_load(slots, served, served * 7, promote=promote)

        self.both(go)

    @rule(data=st.data())
    def end_a_hold(self, data: st.DataObject) -> None:
        if not self.ref.holds:
            return
        hid = data.draw(st.sampled_from(sorted(self.ref.holds)))
        how = data.draw(st.sampled_from(["complete", "cancel", "unread"]))

        def go(s: Side) -> Any:
            slots = s.holds.pop(hid)
            if how == "complete":
                return s.ix.complete_load(slots, len(slots), len(slots), promote=True)
            if how == "cancel":
                return s.ix.cancel_load(slots)
            return s.ix.unread(slots)

        self.both(go)

    @rule(first=st.integers(0, 30), n=st.integers(1, 8))
    def remove(self, first: int, n: int) -> None:
        self.both(lambda s: s.ix.remove([key(i) for i in range(first, first + n)]))

    @rule(first=st.integers(0, 30), n=st.integers(1, 5), pin=st.booleans())
    def pin(self, first: int, n: int, pin: bool) -> None:
        keys = [key(i) for i in range(first, first + n)]
        self.both(lambda s: s.ix.pin(keys) if pin else s.ix.unpin(keys))

    @rule(first=st.integers(0, 30), n=st.integers(1, 5))
    def touch_and_lookup(self, first: int, n: int) -> None:
        keys = [key(i) for i in range(first, first + n)]

        def go(s: Side) -> Any:
            s.ix.touch(keys)
            hits = s.ix.present_run(keys)
            s.ix.note_lookup(keys, len(hits))
            return hits

        self.both(go)

    @rule(t=st.integers(0, 1), n=st.integers(1, 6), ok=st.booleans())
    def make_room(self, t: int, n: int, ok: bool) -> None:
        def go(s: Side) -> Any:
            room = s.ix.prepare_eviction(t, n)
            if not isinstance(room, Eviction):
                return room
            below = s.ix.tiers[room.target]
            ext = below.allocate(len(room.victims))
            if ext is None:
                return room, s.ix.drop_moves(t, list(room.victims))
            offsets = [o for e in ext for o in range(e.offset, e.offset + e.units)]
            landed = [
                s.ix.new_slot(v.key, room.target, o, v.value_bytes)
                for v, o in zip(room.victims, offsets, strict=True)
            ]
            written = [ok or i % 2 == 0 for i in range(len(landed))]
            return room, s.ix.complete_move(list(room.victims), landed, written, drop=True)

        self.both(go)

    @invariant()
    def same_books(self) -> None:
        if not hasattr(self, "ref"):
            return
        r, n = self.ref, self.nat
        assert r.ix.stats() == n.ix.stats()
        assert r.events == n.events
        assert r.placement.calls == n.placement.calls
        assert sorted(r.ix.keys()) == sorted(n.ix.keys())
        for t in range(2):
            assert r.ix.coldest(t, 100) == n.ix.coldest(t, 100)  # eviction order, pins
            assert r.ix.hottest(t) == n.ix.hottest(t)
            assert r.ix.evictable_slots(t) == n.ix.evictable_slots(t)
            assert r.tiers[t].stats() == n.tiers[t].stats()  # the same releases
        all_keys = [key(i) for i in range(40)]
        assert [project(s) for s in r.ix.present_run(all_keys)] == [
            project(s) for s in n.ix.present_run(all_keys)
        ]


Lockstep.TestCase.settings = settings(max_examples=120, stateful_step_count=50, deadline=None)
TestLockstep = Lockstep.TestCase


class QuotaLockstep(Lockstep):
    """With quotas the native index calls the reference's verbs: still the same answers."""

    quotas = Quotas({}, {})


QuotaLockstep.TestCase.settings = settings(max_examples=20, stateful_step_count=30, deadline=None)
TestQuotaLockstep = QuotaLockstep.TestCase


def test_other_eviction_policies_take_the_reference_verbs() -> None:
    class FIFO(LRUEviction):  # not the built-in LRU: the C verbs do not keep its books
        def touch(self, key: ChunkKey) -> None:
            pass

    tiers = [MetaTier(TierGeometry("t0", 8 * SLOT, SLOT, 8 * SLOT))]
    ix = make_index(tiers, FIFO, PlacementPolicy(), lambda e: None)
    claimed = ix.prepare_store([key(1), key(2)])
    ix.add_stored(0, [(k, i) for i, (_, k) in enumerate(claimed)], SLOT)
    ix.complete_store(claimed, 2, 0)
    ix.complete_load(ix.prepare_load([key(2), key(1)]), 2, 2 * SLOT, promote=True)
    assert ix.coldest(0, 2) == [key(2), key(1)]  # FIFO: the touches changed nothing
    assert ix.present_run([key(1)])[0].offset == 0


def test_room_reports_alike() -> None:
    for native in (False, True):
        tiers = [MetaTier(TierGeometry("t0", 2 * SLOT, SLOT, 8 * SLOT))]
        ix = make_index(tiers, LRUEviction, PlacementPolicy(), lambda e: None, native=native)
        assert ix.prepare_eviction(0, 1) is Room.FREE
