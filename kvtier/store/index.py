"""The store's books: which chunk lives in which slot, who holds it, and what was counted.

Everything here is guarded by one lock, which the index takes itself: every public
method takes it, and the private ``_locked`` helpers expect it held. The placement's
hooks run under it too (the contract of :mod:`kvtier.store.policy`), called from here.
Nothing here moves bytes: the only calls into a tier are allocator releases and a
persistent tier's ``forget`` when a slot is freed (the :class:`~kvtier.store.mover.Mover`
does every transfer).

The mover and the store change the books through two-phase verbs, as vLLM's offloading
manager does (``prepare_store``, then ``complete_store(success)``): a load, a store or a
move is *prepared* (keys claimed, slots read-held, nothing visible yet), its bytes move
with no lock held, and it is then *completed* (indexed, repointed, counted) or
*cancelled* (nothing changed). Eviction is atomic: a round of
:meth:`StoreIndex.prepare_eviction` claims exactly the victims that make the room, or
changes nothing.

A *slot* is one stored copy of a chunk; an *entry* is the index record of a chunk and
points at its current slot. A slot whose chunk moved or was deleted is *retired*: its
bytes stay untouched until its last reader is done, and only then is it released to its
tier. That is what keeps a concurrent demotion, promotion or delete from ever handing a
reader bytes that a new put has overwritten.
"""

from __future__ import annotations

import dataclasses
import enum
import logging
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvtier.keys import ChunkKey
from kvtier.store.policy import EvictionFactory, EvictionPolicy, PlacementPolicy
from kvtier.store.quota import QuotaBooks, Quotas, TenantOrders
from kvtier.store.slots import Entry, Slot, runs_of
from kvtier.store.types import Counters, EventKind, StoreEvent, StoreStats
from kvtier.tiers.base import PersistentTier, SlotRun, Tier

log = logging.getLogger(__name__)


class Room(enum.Enum):
    """How a round of :meth:`StoreIndex.prepare_eviction` ended without a move to make."""

    FREE = "free"
    """The tier has the room: nothing to evict."""
    SHORT = "short"
    """Its evictable chunks cannot make the room: nothing changed."""
    DROPPED = "dropped"
    """Victims were taken out of the index (the placement sent them nowhere)."""


@dataclass(frozen=True, slots=True)
class Eviction:
    """Victims claimed by :meth:`StoreIndex.prepare_eviction` for a move down.

    Attributes:
        victims: their slots, read-held and marked moving until the move ends
            (:meth:`StoreIndex.complete_move` or :meth:`StoreIndex.drop_moves`).
        target: the tier the placement sends them to.
    """

    victims: tuple[Slot, ...]
    target: int


class StoreIndex:
    """Entries, pins, per-tier eviction orders and counters of one store.

    Args:
        tiers: the store's tiers, top first (the index releases slots to them).
        eviction: builds one eviction policy per tier.
        placement: the store's placement; the index runs its hooks under its lock.
        emit: announces index changes (INDEXED / UNINDEXED events).
        quotas: per-tenant byte limits per tier (:mod:`kvtier.store.quota`), or None.
    """

    # The record types this index builds (the native index builds its C ones).
    _slot: Callable[[ChunkKey, int, int, int], Slot] = Slot
    _entry: Callable[[Slot], Entry] = Entry

    def __init__(
        self,
        tiers: Sequence[Tier],
        eviction: EvictionFactory,
        placement: PlacementPolicy,
        emit: Callable[[StoreEvent], None],
        quotas: Quotas | None = None,
    ) -> None:
        self.tiers = tuple(tiers)
        self._placement = placement
        # The tiers told of every slot freed (they journal it), by position.
        self._persistent = [t if isinstance(t, PersistentTier) else None for t in self.tiers]
        # Reentrant: the placement's hooks run under it and may read the index back
        # through its TierView methods, which take it too. Named without an underscore
        # only as the lock those hooks are promised to run under: nothing outside the
        # index takes it.
        self.lock = threading.RLock()
        self._counts = Counters()
        self._entries: dict[ChunkKey, Entry] = {}
        # Keys a put has claimed but not yet indexed: a second put skips them.
        self._pending: set[ChunkKey] = set()
        # With quotas, each tier's order also keeps each tenant's (prepare_quota).
        self._orders = None if quotas is None else [TenantOrders(eviction) for _ in self.tiers]
        self._evict: list[EvictionPolicy] = [*(self._orders or (eviction() for _ in tiers))]
        self._tier_hits = [0] * len(self.tiers)
        self._failures: dict[tuple[str, str], int] = {}
        # Index changes go out as INDEXED / UNINDEXED events, under the lock (so their
        # order is the index's), before the operation that caused them completes.
        self._emit = emit
        self._gone: list[Slot] = []  # removed by the operation in progress
        # Slots freed by the operation in progress, released together at its end (see
        # _FreeBatch); None while no batch is open.
        self._frees: list[Slot] | None = None
        self._batch = _FreeBatch(self)
        self.books = None if quotas is None else QuotaBooks(quotas, self.tiers, self.lock)

    # -- queries, pins and deletes ---------------------------------------------------------

    def present_run(self, keys: Sequence[ChunkKey]) -> list[Slot]:
        """Slots of the leading ``keys`` the index holds (no hold taken)."""
        out: list[Slot] = []
        with self.lock:
            for key in keys:
                e = self._entries.get(key)
                if e is None:
                    break
                out.append(e.slot)
        return out

    def new_slot(self, key: ChunkKey, tier: int, offset: int, value_bytes: int) -> Slot:
        """A slot record of this index's kind, for a copy a mover is about to make."""
        return self._slot(key, tier, offset, value_bytes)

    def keys(self) -> list[ChunkKey]:
        """Every indexed key (a snapshot; no bytes read). Thread-safe."""
        with self.lock:
            return list(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def pin(self, keys: Sequence[ChunkKey]) -> list[ChunkKey]:
        """Pin the present ``keys`` once each; returns those pinned."""
        with self.lock:
            held = [k for k in keys if k in self._entries]
            for k in held:
                self._entries[k].pins += 1
        return held

    def unpin(self, keys: Sequence[ChunkKey]) -> None:
        with self.lock:
            for key in keys:
                e = self._entries.get(key)
                if e is not None and e.pins:
                    e.pins -= 1

    def touch(self, keys: Sequence[ChunkKey]) -> None:
        """Mark chunks as used, last key first, so a sequence's tail is evicted before its head."""
        with self.lock:
            for key in reversed(keys):
                e = self._entries.get(key)
                if e is not None:
                    self._evict[e.slot.tier].touch(key)

    def remove(self, keys: Sequence[ChunkKey]) -> list[ChunkKey]:
        """Take ``keys`` out of the index; returns those that were present."""
        gone: list[ChunkKey] = []
        with self.lock, self._batch:
            for key in keys:
                e = self._entries.get(key)
                if e is not None:
                    self._remove_locked(key, e)
                    gone.append(key)
            self._emit_gone_locked()
        return gone

    def note_deleted(self, n: int) -> None:
        """Count ``n`` chunks a delete removed (from the index or a shared medium)."""
        with self.lock:
            self._counts.deleted_chunks += n

    # -- loads (gets) ----------------------------------------------------------------------

    def prepare_load(self, keys: Sequence[ChunkKey]) -> list[Slot]:
        """Read-hold the slots of the leading present ``keys``, mark them used, and count
        a get.

        Every slot returned must be given back: by :meth:`complete_load` once read, by
        :meth:`cancel_load` when the get does not happen, or by :meth:`unread`.
        """
        with self.lock:
            slots: list[Slot] = []
            for key in keys:
                e = self._entries.get(key)
                if e is None:
                    break
                e.slot.readers += 1
                slots.append(e.slot)
            for sl in reversed(slots):  # head most recent, as in touch()
                self._evict[sl.tier].touch(sl.key)
            self._counts.gets += 1
        return slots

    def cancel_load(self, slots: Sequence[Slot]) -> None:
        """Give back the holds of a :meth:`prepare_load` whose get did not happen (uncounted)."""
        self.unread(slots)
        with self.lock:
            self._counts.gets -= 1

    def unread(self, slots: Sequence[Slot]) -> None:
        """Give back the read holds of ``slots``, counting nothing."""
        with self.lock, self._batch:
            for sl in slots:
                self._unread_locked(sl)

    def complete_load(
        self, slots: Sequence[Slot], served: int, nbytes: int, *, promote: bool
    ) -> list[list[ChunkKey]]:
        """End a load: give back the holds of ``slots``, and count their first ``served``
        (``nbytes`` of values) as hits, in the counters and the placement.

        Returns the served keys the placement wants promoted to the top tier, one list
        per lower tier they were served from (none unless ``promote``).
        """
        with self.lock:
            with self._batch:
                for sl in slots:
                    self._unread_locked(sl)
            by_tier = self._note_hits(slots[:served], nbytes)
            for t, ks in by_tier.items():
                self._placement.on_hit(t, ks)
            return [
                ks
                for t, ks in by_tier.items()
                if promote and t > 0 and self._placement.should_promote(t, ks)
            ]

    def _note_hits(self, served: Sequence[Slot], nbytes: int) -> dict[int, list[ChunkKey]]:
        """Count a get's served chunks; returns their keys by tier. Lock held."""
        by_tier: dict[int, list[ChunkKey]] = {}
        self._counts.get_chunks += len(served)
        self._counts.get_bytes += nbytes
        for sl in served:
            self._tier_hits[sl.tier] += 1
            by_tier.setdefault(sl.tier, []).append(sl.key)
            if self.books is not None:
                self.books.figures.read(sl.key, sl.tier, sl.value_bytes)
        return by_tier

    def forget_failed(self, slots: Sequence[Slot], *, corrupt: bool) -> None:
        """Chunks whose read failed are never served again: they become misses."""
        with self.lock, self._batch:
            for sl in slots:
                e = self._entries.get(sl.key)
                if e is not None and e.slot is sl:
                    self._remove_locked(sl.key, e)
            if corrupt:
                self._counts.corrupt_chunks += len(slots)
            self._emit_gone_locked()

    def note_lookup(self, keys: Sequence[ChunkKey], found: Sequence[Slot]) -> None:
        """Count a lookup of ``keys`` whose first ones were ``found``; the rest are
        misses the placement hears of."""
        with self.lock:
            if self.books is not None:
                self.books.figures.looked_up(found, keys[len(found) :])
            counts = self._counts
            counts.lookups += 1
            counts.lookup_hit_chunks += len(found)
            counts.lookup_miss_chunks += len(keys) - len(found)
            if len(found) < len(keys):
                self._placement.on_miss(keys[len(found) :])

    # -- stores (puts) ---------------------------------------------------------------------

    def admit(self, t: int, keys: Sequence[ChunkKey], value_bytes: int) -> bool:
        """Whether the placement admits these new chunks into tier ``t``."""
        with self.lock:
            return self._placement.admit(t, keys, value_bytes)

    def prepare_store(self, keys: Sequence[ChunkKey]) -> list[tuple[int, ChunkKey]]:
        """Claim the ``keys`` that are neither indexed nor being put, as (position, key),
        and count a put.

        The claimed keys stay pending (a concurrent put counts them present) until
        :meth:`complete_store`; what was written meanwhile is indexed by :meth:`add_stored`.
        """
        with self.lock:
            fresh: list[tuple[int, ChunkKey]] = []
            seen: set[ChunkKey] = set()
            for i, k in enumerate(keys):
                # A key twice in one call is stored once (the second would leak a slot).
                if k not in self._entries and k not in self._pending and k not in seen:
                    fresh.append((i, k))
                    seen.add(k)
            self._pending.update(k for _, k in fresh)
            self._counts.puts += 1
            self._counts.put_present += len(keys) - len(fresh)
        return fresh

    def add_stored(self, t: int, written: Sequence[tuple[ChunkKey, int]], value_bytes: int) -> None:
        """Index chunks of a put just written into tier ``t``, as (key, slot number) in
        sequence order."""
        with self.lock:
            self._add_locked(t, written, value_bytes)

    def complete_store(
        self, claimed: Sequence[tuple[int, ChunkKey]], stored: int, failed: int
    ) -> None:
        """End a put of the ``claimed`` keys: ``stored`` were written and indexed,
        ``failed`` failed in a tier; the rest were rejected."""
        with self.lock:
            self._pending.difference_update(k for _, k in claimed)
            self._counts.put_chunks += stored
            self._counts.put_rejected += len(claimed) - stored - failed

    def prepare_store_one(self, key: ChunkKey) -> bool:
        """Claim one key for a put in place (the store's ``reserve``); False when it is
        indexed or being put. Counts nothing: the put is counted when it completes."""
        with self.lock:
            if key in self._entries or key in self._pending:
                return False
            self._pending.add(key)
            return True

    def cancel_store_one(self, key: ChunkKey) -> None:
        """Give back a :meth:`prepare_store_one` that led to no put."""
        with self.lock:
            self._pending.discard(key)

    def complete_store_one(self, t: int, key: ChunkKey, slot_no: int, value_bytes: int) -> None:
        """Index one chunk of a :meth:`prepare_store_one`, filled in place in slot
        ``slot_no`` of tier ``t``, and count its put."""
        with self.lock:
            self._counts.puts += 1
            self._add_locked(t, [(key, slot_no)], value_bytes)
            self._pending.discard(key)
            self._counts.put_chunks += 1

    def _add_locked(
        self, t: int, written: Sequence[tuple[ChunkKey, int]], value_bytes: int
    ) -> None:
        # Newest-last in eviction order, tail first: a sequence loses its tail before
        # its head, so what stays is still a usable prefix.
        for key, slot_no in reversed(written):
            self._entries[key] = self._entry(self._slot(key, t, slot_no, value_bytes))
            self._evict[t].insert(key, value_bytes)
        if self.books is not None:
            self.books.charge([k for k, _ in written], t, 1, stored=value_bytes)
        if written:
            keys = tuple(k for k, _ in written)
            self._emit_keys(EventKind.INDEXED, t, keys, len(keys) * value_bytes)

    def add_adopted(
        self,
        t: int,
        keys: Sequence[ChunkKey],
        offsets: Sequence[int],
        lengths: Sequence[int],
        *,
        hold: bool,
    ) -> list[Slot]:
        """Index chunks found in shared tier ``t`` in the slots claimed for them.

        A key indexed meanwhile (by a put or another adoption) keeps its slot, and the
        one claimed for it goes back to the tier. Returns the slots in key order,
        read-held when ``hold``.
        """
        tier = self.tiers[t]
        out: list[Slot] = []
        new: list[ChunkKey] = []
        with self.lock:
            for key, offset, length in zip(keys, offsets, lengths, strict=True):
                e = self._entries.get(key)
                if e is None:
                    e = self._entries[key] = self._entry(self._slot(key, t, offset, length))
                    new.append(key)
                else:
                    tier.release(offset, 1)
                if hold:
                    e.slot.readers += 1
                out.append(e.slot)
            for key in reversed(new):  # head most recent, as in add_written
                self._evict[t].insert(key, self._entries[key].slot.value_bytes)
                if self.books is not None:
                    self.books.charge([key], t, 1)
            self._counts.adopted_chunks += len(new)
            if new:
                nbytes = sum(self._entries[k].slot.value_bytes for k in new)
                self._emit_keys(EventKind.INDEXED, t, tuple(new), nbytes)
        return out

    # -- room (the placement's TierView) ---------------------------------------------------

    def free_slots(self, tier: int) -> int:
        """Free slots of ``tier`` (:class:`~kvtier.store.policy.TierView`)."""
        return self.tiers[tier].free_slots

    def coldest(self, tier: int, n: int) -> list[ChunkKey]:
        """Up to ``n`` of ``tier``'s next victims, pinned and busy ones skipped
        (:class:`~kvtier.store.policy.TierView`: placement compares them with a victim
        from above before it demotes one)."""
        with self.lock:
            return self._coldest_locked(tier, n)

    def stored_bytes(self, keys: Sequence[ChunkKey]) -> int:
        """Bytes of value the indexed chunks among ``keys`` hold
        (:class:`~kvtier.store.policy.TierView`: what the write budget is charged)."""
        with self.lock:
            entries = self._entries
            return sum(e.slot.value_bytes for k in keys if (e := entries.get(k)) is not None)

    def evictable_slots(self, t: int) -> int:
        """Free slots of tier ``t`` plus those its evictable chunks hold."""
        with self.lock:
            evictable = sum(
                1
                for e in self._entries.values()
                if e.slot.tier == t and not (e.pins or e.moving or e.slot.readers)
            )
            return self.tiers[t].free_slots + evictable

    def _coldest_locked(self, t: int, n: int) -> list[ChunkKey]:
        out: list[ChunkKey] = []
        if n < 1:
            return out
        for key in self._evict[t].candidates():
            e = self._entries.get(key)
            if e is None or e.pins or e.moving or e.slot.readers or e.slot.tier != t:
                continue
            out.append(key)
            if len(out) >= n:
                break
        return out

    def hottest(self, t: int) -> list[ChunkKey]:
        """Keys of tier ``t``, most recently used first (by its eviction order)."""
        with self.lock:
            keys = list(self._evict[t].candidates())
        keys.reverse()
        return keys

    # -- moves (demotions, promotions, drops) ----------------------------------------------

    def prepare_eviction(self, t: int, n: int) -> Room | Eviction:
        """One round of making room for ``n`` slots in tier ``t``; atomic.

        Returns :attr:`Room.FREE` when the tier has them free already, and
        :attr:`Room.SHORT`, having changed nothing, when its evictable chunks cannot
        free them. Otherwise exactly the missing number of its coldest chunks are
        claimed as victims, and the placement names where they go: nowhere (they are
        dropped now, :attr:`Room.DROPPED`), or a lower tier (an :class:`Eviction` whose
        move the caller ends with :meth:`complete_move` or :meth:`drop_moves`).
        """
        with self.lock:
            deficit = n - self.tiers[t].free_slots
            if deficit <= 0:
                return Room.FREE
            victims = self._claim_locked(self._coldest_locked(t, deficit), range(t, t + 1))
            if len(victims) < deficit:
                self._unclaim_locked(victims)
                return Room.SHORT
            keys = [v.key for v in victims]
            if self.books is not None:
                self.books.figures.evicted(keys, t)
            target = self._placement.demote_target(t, len(self.tiers), keys)
            if target is None:
                self._drop_locked(t, victims)
                return Room.DROPPED
            return Eviction(tuple(victims), target)

    def prepare_quota(
        self, t: int, tag: int, nbytes: int, *, evict: bool = True
    ) -> Room | Eviction:
        """A round of making room for ``nbytes`` of tenant ``tag`` within its quota in
        tier ``t``, as :meth:`prepare_eviction` does for the tier, but among the tenant's
        own chunks only. :attr:`Room.FREE`: they fit (or the tenant has no limit there)
        and are reserved (give them back with ``books.release``)."""
        with self.lock:
            over = 0 if self.books is None else self.books.try_reserve(tag, t, nbytes)
            if over <= 0:
                return Room.FREE
            need = -(-over // self.tiers[t].slot_bytes)  # chunks
            keys: list[ChunkKey] = []
            orders = self._orders[t].candidates_of(tag) if evict and self._orders else ()
            for key in orders:
                e = self._entries.get(key)
                if not (e is None or e.pins or e.moving or e.slot.readers):
                    keys.append(key)
                    if len(keys) >= need:
                        break
            if len(keys) < need:
                return Room.SHORT
            victims = self._claim_locked(keys, range(t, t + 1))
            self.books.figures.evicted(keys, t)  # type: ignore[union-attr]  # over > 0: books
            target = self._placement.demote_target(t, len(self.tiers), keys)
            if target is None:
                self._drop_locked(t, victims)
                return Room.DROPPED
            return Eviction(tuple(victims), target)

    def prepare_move(self, keys: Sequence[ChunkKey], from_tiers: range) -> list[Slot]:
        """Claim the indexed ``keys`` that lie in ``from_tiers`` for a move: marked as
        moving (no other mover takes them) and read-held. Returns their slots; the
        caller ends the move with :meth:`complete_move`, :meth:`cancel_move` or
        :meth:`drop_moves`."""
        with self.lock:
            return self._claim_locked(keys, from_tiers)

    def cancel_move(self, slots: Sequence[Slot]) -> None:
        """Undo a claim for a move: the chunks stay where they are."""
        with self.lock, self._batch:
            self._unclaim_locked(slots)

    def drop_moves(self, t: int, victims: Sequence[Slot]) -> int:
        """Take chunks claimed for a move out of the index instead (tier ``t`` must lose
        them and no tier below takes them); returns how many went."""
        with self.lock:
            return self._drop_locked(t, victims)

    def complete_move(
        self,
        victims: Sequence[Slot],
        landed: Sequence[Slot],
        written: Sequence[bool],
        *,
        drop: bool,
    ) -> int:
        """End a move: point each victim's chunk at its ``landed`` slot where it was
        ``written``; returns how many moved (counted as promoted when they went up, as
        demoted when they went down).

        A chunk whose copy failed is dropped when ``drop`` (a victim that must leave its
        tier) and stays where it was otherwise. A landed slot the index does not take
        (the copy failed, or the chunk was deleted meanwhile) goes back to its tier. The
        old copies are released once their last reader is done.
        """
        moved = 0
        with self.lock, self._batch:
            for old, new, ok in zip(victims, landed, written, strict=True):
                if self._repoint_locked(old, new if ok else None, drop=drop):
                    moved += 1
                    if new.tier < old.tier:
                        self._counts.promoted_chunks += 1
                    else:
                        self._counts.demoted_chunks += 1
                else:
                    self.tiers[new.tier].release(new.offset, 1)
        return moved

    def _claim_locked(self, keys: Sequence[ChunkKey], from_tiers: range) -> list[Slot]:
        out: list[Slot] = []
        for key in keys:
            e = self._entries.get(key)
            if e is None or e.moving or e.slot.tier not in from_tiers:
                continue
            e.moving = True
            e.slot.readers += 1
            out.append(e.slot)
        return out

    def _unclaim_locked(self, slots: Sequence[Slot]) -> None:
        for sl in slots:
            e = self._entries.get(sl.key)
            if e is not None and e.slot is sl:
                e.moving = False
            self._unread_locked(sl)

    def _drop_locked(self, t: int, victims: Sequence[Slot]) -> int:
        dropped = 0
        with self._batch:
            self._unclaim_locked(victims)
            for sl in victims:
                e = self._entries.get(sl.key)
                if e is not None and e.slot is sl:
                    self._remove_locked(sl.key, e)
                    dropped += 1
        self._counts.dropped_chunks += dropped
        self._emit_gone_locked()
        self._emit(StoreEvent(EventKind.DROPPED, self.tiers[t].name, dropped, 0))
        return dropped

    def _repoint_locked(self, old: Slot, new: Slot | None, *, drop: bool) -> bool:
        """End one claimed move: point the chunk at ``new`` if it was written (else
        drop it when ``drop``). Returns whether the chunk moved."""
        e = self._entries.get(old.key)
        current = e is not None and e.slot is old
        moved = False
        if e is not None and current:
            e.moving = False
            if new is not None:
                self._evict[old.tier].remove(old.key)
                e.slot = new
                self._evict[new.tier].insert(old.key, old.value_bytes)
                if self.books is not None:
                    self.books.charge([old.key], old.tier, -1, to=new.tier, stored=old.value_bytes)
                self._retire_locked(old)
                moved = True
            elif drop:
                self._remove_locked(old.key, e)
                self._counts.dropped_chunks += 1
                self._emit_gone_locked()
        self._unread_locked(old)
        return moved

    # -- slot lifetime (lock held) ---------------------------------------------------------

    def _remove_locked(self, key: ChunkKey, e: Entry) -> None:
        """Take a chunk out of the index; its bytes go when the last reader is done.

        The caller ends its operation with :meth:`_emit_gone_locked`.
        """
        del self._entries[key]
        self._evict[e.slot.tier].remove(key)
        if self.books is not None:
            self.books.charge([key], e.slot.tier, -1)
        self._gone.append(e.slot)
        self._retire_locked(e.slot)

    def _emit_gone_locked(self) -> None:
        """Announce the chunks removed since the last call (one event per tier)."""
        if not self._gone:
            return
        gone, self._gone = self._gone, []
        by_tier: dict[int, list[Slot]] = {}
        for sl in gone:
            by_tier.setdefault(sl.tier, []).append(sl)
        for t, slots in by_tier.items():
            nbytes = sum(sl.value_bytes for sl in slots)
            self._emit_keys(EventKind.UNINDEXED, t, tuple(sl.key for sl in slots), nbytes)

    def _emit_keys(self, kind: EventKind, t: int, keys: tuple[ChunkKey, ...], nbytes: int) -> None:
        self._emit(StoreEvent(kind, self.tiers[t].name, len(keys), nbytes, keys=keys))

    def _retire_locked(self, sl: Slot) -> None:
        sl.retired = True
        if sl.readers == 0:
            self._free_slot_locked(sl)

    def _unread_locked(self, sl: Slot) -> None:
        sl.readers -= 1
        if sl.retired and sl.readers == 0:
            self._free_slot_locked(sl)

    def _free_slot_locked(self, sl: Slot) -> None:
        if self._frees is not None:
            self._frees.append(sl)
            return
        keeper = self._persistent[sl.tier]
        if keeper is not None:
            keeper.forget(SlotRun(sl.offset, (sl.key,), sl.value_bytes))
        self.tiers[sl.tier].release(sl.offset, 1)

    def _release_runs(self, frees: list[Slot]) -> None:
        """Give ``frees`` back to their tiers, a run of consecutive slots at a time."""
        if len(frees) > 1:
            frees.sort(key=lambda sl: (sl.tier, sl.offset))
        for _, t, run in runs_of(frees):
            keeper = self._persistent[t]
            if keeper is not None:
                keeper.forget(run)
            self.tiers[t].release(run.offset, run.n)

    # -- start-up, failures and stats ------------------------------------------------------

    def recover(self) -> None:
        """Index what persistent tiers kept across a restart; a higher tier's copy wins.

        Called once, by the store, before any other call."""
        for t, tier in enumerate(self._persistent):
            if tier is None:
                continue
            recovered = 0
            for run in tier.recover():
                for j, key in enumerate(run.keys):
                    slot = self._slot(key, t, run.offset + j, run.value_bytes)
                    if key in self._entries:
                        self._free_slot_locked(slot)
                        continue
                    self._entries[key] = self._entry(slot)
                    self._evict[t].insert(key, run.value_bytes)
                    if self.books is not None:
                        self.books.charge([key], t, 1)
                    recovered += 1
            if recovered:
                log.info("tier %s: recovered %d chunks", tier.name, recovered)

    def note_failure(self, tier: str, op: str) -> int:
        """Count one tier failure; returns how many of this (tier, op) came before."""
        with self.lock:
            self._counts.tier_errors += 1
            seen = self._failures.get((tier, op), 0)
            self._failures[(tier, op)] = seen + 1
        return seen

    def stats(self) -> StoreStats:
        """A frozen snapshot of the counters, with each tier's own stats and what the
        placement reports (read under the lock its hooks run under)."""
        with self.lock:
            counts = dataclasses.asdict(self._counts)
            chunks = len(self._entries)
            hits = tuple((t.name, n) for t, n in zip(self.tiers, self._tier_hits, strict=True))
            report = tuple(self._placement.report())
        return StoreStats(
            chunks=chunks,
            tier_hits=hits,
            tiers=tuple(t.stats() for t in self.tiers),
            placement=report,
            **counts,
        )


class _FreeBatch:
    """A context (lock held) whose freed slots are released together at its end.

    Deleting or evicting a sequence frees whole extents: one release of a run of slots
    lets the allocator free each buddy block at once, where a release per slot splits
    the block down to single slots and coalesces it back up (a cost per chunk in every
    put that made room). Nested contexts join the outermost one. A plain class: a
    generator-based context manager cost more than it saved on one-chunk operations.
    """

    __slots__ = ("_depth", "_index")

    def __init__(self, index: StoreIndex) -> None:
        self._index = index
        self._depth = 0

    def __enter__(self) -> None:
        if self._depth == 0:
            self._index._frees = []
        self._depth += 1

    def __exit__(self, *exc: object) -> None:
        self._depth -= 1
        if self._depth == 0:
            frees, self._index._frees = self._index._frees, None
            if frees:
                self._index._release_runs(frees)
