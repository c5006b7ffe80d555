"""The tiered store: one index over a stack of tiers, and the movers between them.

* ``put`` writes new chunks into the top tier the placement policy admits, laying each
  run out as adaptive extents (binary decomposition), after making room by demoting or
  dropping victims chosen by the tier's eviction policy.
* ``lookup`` answers how many leading chunks are present, and where. Cheap, no I/O,
  except that chunks missing from the index are looked for in *shared* tiers (Redis:
  other processes store there too); found ones are adopted into the index.
* ``get`` copies a leading run into the caller's buffer; a hit in a lower tier may be
  promoted afterwards, in the background.
* ``delete``, ``pin``/``unpin``, ``stats``, listeners for events.

Threading: public methods may be called from any thread. The index is guarded by one
lock; bytes move on the store's I/O threads, never under the lock and never on the
caller's thread (``put`` and ``get`` return futures). Every read holds the slot it
reads; a slot whose chunk moved or was deleted is released to its tier only when its
last reader is done, so no slot is reused while bytes are in flight.

Failures of a tier (I/O errors, corrupt bytes) never escape as exceptions: they become
misses, a counter, an event and a rate-limited log line.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TypeVar

import numpy as np

from kvtier.alloc import Extent
from kvtier.errors import ClosedError, CorruptChunkError, InputError, TierError
from kvtier.keys import ChunkKey
from kvtier.store.policy import EvictionFactory, LRUEviction, PlacementPolicy, WriteThrough
from kvtier.store.types import (
    EventKind,
    GetResult,
    LookupResult,
    PutResult,
    StoreEvent,
    StoreStats,
)
from kvtier.tiers.base import SlotRun, Tier

log = logging.getLogger(__name__)

Buffer = memoryview | bytes | bytearray | np.ndarray
Listener = Callable[[StoreEvent], None]
T = TypeVar("T")

_MAKE_ROOM_ROUNDS = 8  # bounded retries when concurrent puts race for freed space


class _Slot:
    """One stored copy of a chunk: where its bytes are, and who is reading them.

    Internal and mutable; guarded by the store lock. A slot is *retired* when its
    chunk moved elsewhere or was deleted; its bytes stay untouched until the last
    reader is done, and only then are they released to the tier's allocator. That is
    what keeps a concurrent demotion, promotion or delete from ever handing a reader
    bytes that a new put has overwritten.
    """

    __slots__ = ("key", "offset", "readers", "retired", "tier", "value_bytes")

    def __init__(self, key: ChunkKey, tier: int, offset: int, value_bytes: int) -> None:
        self.key = key
        self.tier = tier
        self.offset = offset
        self.value_bytes = value_bytes
        self.readers = 0
        self.retired = False


class _Entry:
    """Index entry of one chunk. Internal; guarded by the store lock."""

    __slots__ = ("moving", "pins", "slot")

    def __init__(self, slot: _Slot) -> None:
        self.slot = slot
        self.pins = 0
        self.moving = False


def _as_bytes_view(buf: Buffer, *, writable: bool) -> memoryview:
    if isinstance(buf, np.ndarray):
        if not buf.flags.c_contiguous:
            raise InputError("buffer must be C-contiguous")
        view = memoryview(buf.reshape(-1).view(np.uint8).data)
    else:
        view = memoryview(buf)
    view = view.cast("B") if view.format != "B" or view.ndim != 1 else view
    if writable and view.readonly:
        raise InputError("destination buffer is read-only")
    return view


def runs_of(locs: Sequence[_Slot]) -> list[tuple[int, int, SlotRun]]:
    """Group slots into runs of consecutive offsets of one tier and equal length.

    Returns (index of the first slot, tier, run) triples, in order.
    """
    out: list[tuple[int, int, SlotRun]] = []
    i = 0
    while i < len(locs):
        first = locs[i]
        j = i + 1
        while (
            j < len(locs)
            and locs[j].tier == first.tier
            and locs[j].offset == first.offset + (j - i)
            and locs[j].value_bytes == first.value_bytes
        ):
            j += 1
        keys = tuple(loc.key for loc in locs[i:j])
        out.append((i, first.tier, SlotRun(first.offset, keys, first.value_bytes)))
        i = j
    return out


class TieredStore:
    """KV chunks over a stack of tiers, fastest first.

    Args:
        tiers: the hierarchy, top first. The store owns them and closes them.
        eviction: builds one eviction policy per tier (default LRU).
        placement: admission and demotion decisions (default: keep everything).
        io_threads: threads that move bytes; 0 runs every operation on the caller's
            thread (a synchronous fast path for metadata-only simulation, where the
            thread hand-offs would cost more than the work).
        promote_on_hit: move chunks hit in a lower tier back to the top, in the background.
    """

    def __init__(
        self,
        tiers: Sequence[Tier],
        *,
        eviction: EvictionFactory = LRUEviction,
        placement: PlacementPolicy | None = None,
        io_threads: int = 4,
        promote_on_hit: bool = True,
    ) -> None:
        if not tiers:
            raise InputError("a store needs at least one tier")
        self.tiers: tuple[Tier, ...] = tuple(tiers)
        self.slot_bytes = min(t.slot_bytes for t in self.tiers)
        self.placement = placement or WriteThrough()
        self.promote_on_hit = promote_on_hit
        self._evict = [eviction() for _ in self.tiers]
        self._shared = [i for i, t in enumerate(self.tiers) if t.shared]
        self._index: dict[ChunkKey, _Entry] = {}
        self._pending: set[ChunkKey] = set()
        self._lock = threading.RLock()
        self._pool: ThreadPoolExecutor | _InlineExecutor = (
            ThreadPoolExecutor(max_workers=io_threads, thread_name_prefix="kvtier-io")
            if io_threads > 0
            else _InlineExecutor()
        )
        self._inflight = 0
        self._idle = threading.Condition(threading.Lock())
        self._listeners: list[Listener] = []
        self._closed = False
        self._c: dict[str, int] = dict.fromkeys(
            [
                "lookups",
                "lookup_hit_chunks",
                "lookup_miss_chunks",
                "gets",
                "get_chunks",
                "get_bytes",
                "puts",
                "put_chunks",
                "put_present",
                "put_rejected",
                "demoted_chunks",
                "promoted_chunks",
                "dropped_chunks",
                "deleted_chunks",
                "corrupt_chunks",
                "tier_errors",
                "adopted_chunks",
            ],
            0,
        )
        self._tier_hits = [0] * len(self.tiers)
        self._logged: dict[tuple[str, str], int] = {}
        self._recover()

    # -- public API ----------------------------------------------------------------------

    def put(
        self, keys: Sequence[ChunkKey], data: Buffer, *, prefix: Sequence[ChunkKey] = ()
    ) -> Future[PutResult]:
        """Store chunks whose values lie packed in ``data`` (equal length each).

        ``prefix`` names the already-stored chunks that precede ``keys`` in the same
        sequence (typically the hit that ``lookup`` returned). They are protected from
        eviction while this put makes room: a sequence longer than the store would
        otherwise push out its own head, leaving every new chunk unreachable.

        ``len(data)`` must be ``len(keys) * value_bytes`` with ``value_bytes`` at most
        :attr:`slot_bytes`. The caller must keep ``data`` alive and unchanged until the
        future completes. Chunks already present are skipped. Never raises for tier
        failures: they show in :class:`PutResult` and the stats.

        Raises:
            InputError: sizes that can never work.
            ClosedError: the store is closed.
        """
        self._check_open()
        view = _as_bytes_view(data, writable=False)
        keys = list(keys)
        if not keys:
            fut: Future[PutResult] = Future()
            fut.set_result(PutResult(0, 0, 0, 0))
            return fut
        if view.nbytes % len(keys):
            raise InputError(f"{view.nbytes} bytes do not split evenly into {len(keys)} chunks")
        value_bytes = view.nbytes // len(keys)
        if not 0 < value_bytes <= self.slot_bytes:
            raise InputError(f"chunk of {value_bytes} B; the store takes 1..{self.slot_bytes} B")
        return self._submit(self._put, keys, view, value_bytes, list(prefix))

    def lookup(self, keys: Sequence[ChunkKey]) -> LookupResult:
        """How many leading ``keys`` are present, and in which tiers. Thread-safe.

        No I/O while the index holds the whole run. Otherwise shared tiers are probed
        for the missing tail (one round trip, bounded by the tier's budget), and chunks
        found there are adopted into the index.
        """
        self._check_open()
        tiers: list[str] = []
        lengths: list[int] = []
        with self._lock:
            for key in keys:
                e = self._index.get(key)
                if e is None:
                    break
                tiers.append(self.tiers[e.slot.tier].name)
                lengths.append(e.slot.value_bytes)
        if len(tiers) < len(keys) and self._shared:
            for sl in self._adopt(keys[len(tiers) :]):
                tiers.append(self.tiers[sl.tier].name)
                lengths.append(sl.value_bytes)
        with self._lock:
            self._c["lookups"] += 1
            self._c["lookup_hit_chunks"] += len(tiers)
            self._c["lookup_miss_chunks"] += len(keys) - len(tiers)
            if len(tiers) < len(keys):
                self.placement.on_miss(keys[len(tiers) :])
        return LookupResult(len(tiers), tuple(tiers), tuple(lengths))

    def get(self, keys: Sequence[ChunkKey], dst: Buffer) -> Future[GetResult]:
        """Copy the leading present chunks of ``keys`` into ``dst``, packed.

        ``dst`` must hold at least the sum of their value lengths (``len(keys) *
        slot_bytes`` always suffices); the caller keeps it alive until the future
        completes. A chunk that fails to read ends the run: the result counts only the
        chunks before it, so the caller never uses bytes that were not verified. Chunks
        missing from the index are looked for in shared tiers on the I/O thread, as in
        :meth:`lookup`.
        """
        self._check_open()
        view = _as_bytes_view(dst, writable=True)
        with self._lock:
            slots: list[_Slot] = []
            for key in keys:
                e = self._index.get(key)
                if e is None:
                    break
                e.slot.readers += 1
                slots.append(e.slot)
            for sl in reversed(slots):  # head most recent, as in touch()
                self._evict[sl.tier].touch(sl.key)
            self._c["gets"] += 1
        need = sum(sl.value_bytes for sl in slots)
        if need > view.nbytes:
            self._unread(slots)
            raise InputError(f"destination of {view.nbytes} B; the hit needs {need} B")
        tail = list(keys[len(slots) :]) if self._shared else []
        return self._submit(self._get, slots, view, tail)

    def delete(self, keys: Sequence[ChunkKey]) -> int:
        """Remove chunks; returns how many were present. Reads in flight finish first.

        Shared tiers delete the values from their medium too (one round trip each), so
        other processes stop finding them; chunks only there count as present.
        """
        self._check_open()
        gone: list[ChunkKey] = []
        with self._lock:
            for key in keys:
                e = self._index.get(key)
                if e is not None:
                    self._remove_locked(key, e)
                    gone.append(key)
        removed = len(gone)
        if self._shared:
            # forget() leaves shared values alone (others may use them); delete must not.
            known = set(gone)
            elsewhere = [k for k in keys if k not in known]
            found_elsewhere = 0
            for t in self._shared:
                if gone:
                    self.tiers[t].discard(gone)
                if elsewhere:
                    found_elsewhere = max(found_elsewhere, self.tiers[t].discard(elsewhere))
            removed += found_elsewhere
        with self._lock:
            self._c["deleted_chunks"] += removed
        if removed:
            self._emit(StoreEvent(EventKind.DELETED, "", removed, 0))
        return removed

    def pin(self, keys: Sequence[ChunkKey]) -> int:
        """Protect present chunks from eviction and demotion; returns how many were pinned."""
        with self._lock:
            n = 0
            for key in keys:
                e = self._index.get(key)
                if e is not None:
                    e.pins += 1
                    n += 1
            return n

    def unpin(self, keys: Sequence[ChunkKey]) -> None:
        """Undo one :meth:`pin` per key; unknown or unpinned keys are ignored."""
        with self._lock:
            for key in keys:
                e = self._index.get(key)
                if e is not None and e.pins:
                    e.pins -= 1

    def touch(self, keys: Sequence[ChunkKey]) -> None:
        """Mark chunks as used, last key first, so a sequence's tail is evicted before its head."""
        with self._lock:
            for key in reversed(keys):
                e = self._index.get(key)
                if e is not None:
                    self._evict[e.slot.tier].touch(key)

    def add_listener(self, listener: Listener) -> None:
        """Call ``listener`` with every :class:`StoreEvent` (from I/O threads; keep it fast)."""
        self._listeners.append(listener)

    def stats(self) -> StoreStats:
        with self._lock:
            c = dict(self._c)
            chunks = len(self._index)
            hits = tuple((t.name, n) for t, n in zip(self.tiers, self._tier_hits, strict=True))
        return StoreStats(
            chunks=chunks, tier_hits=hits, tiers=tuple(t.stats() for t in self.tiers), **c
        )

    def drain(self) -> None:
        """Wait until no operation is queued or running, background promotions included."""
        with self._idle:
            self._idle.wait_for(lambda: self._inflight == 0)

    def flush(self) -> None:
        """Wait for queued work, then make persistent tiers durable.

        A tier that fails to flush (a full disk) is logged and counted, never raised:
        its chunks that did not become durable are lost on restart, which is a miss.
        """
        self.drain()
        for i, t in enumerate(self.tiers):
            self._flush_tier(i, t)

    def _flush_tier(self, i: int, t: Tier) -> None:
        try:
            t.flush()
        except TierError as exc:
            self._tier_failed(i, "flush", exc, 0)

    def close(self) -> None:
        """Finish queued work, flush and close every tier. Idempotent."""
        if self._closed:
            return
        self.drain()
        self._closed = True
        self._pool.shutdown(wait=True)
        for i, t in enumerate(self.tiers):
            try:
                self._flush_tier(i, t)
            finally:
                try:
                    t.close()
                except TierError as exc:
                    self._tier_failed(i, "close", exc, 0)

    def __enter__(self) -> TieredStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _submit(self, fn: Callable[..., T], *args: object) -> Future[T]:
        """Run ``fn`` on an I/O thread, counted so :meth:`drain` can wait for it."""
        with self._idle:
            self._inflight += 1
        try:
            fut = self._pool.submit(fn, *args)
        except RuntimeError as exc:  # the pool was shut down by close()
            self._done(None)
            raise ClosedError("the store is closed") from exc
        fut.add_done_callback(self._done)
        return fut

    def _done(self, _fut: object) -> None:
        with self._idle:
            self._inflight -= 1
            if self._inflight == 0:
                self._idle.notify_all()

    # -- workers -------------------------------------------------------------------------

    def _put(
        self, keys: list[ChunkKey], view: memoryview, value_bytes: int, prefix: list[ChunkKey]
    ) -> PutResult:
        with self._lock:
            held = [k for k in prefix if k in self._index]
            for k in held:
                self._index[k].pins += 1
        try:
            return self._put_pinned(keys, view, value_bytes)
        finally:
            self.unpin(held)

    def _put_pinned(self, keys: list[ChunkKey], view: memoryview, value_bytes: int) -> PutResult:
        with self._lock:
            fresh = []
            seen: set[ChunkKey] = set()
            for i, k in enumerate(keys):
                # A key twice in one call is stored once (the second would leak a slot).
                if k not in self._index and k not in self._pending and k not in seen:
                    fresh.append((i, k))
                    seen.add(k)
            self._pending.update(k for _, k in fresh)
            self._c["puts"] += 1
            self._c["put_present"] += len(keys) - len(fresh)
        stored = failed = 0
        try:
            todo = fresh
            for t in range(len(self.tiers)):
                if not todo:
                    break
                todo_keys = [k for _, k in todo]
                with self._lock:
                    admitted = self.placement.admit(t, todo_keys, value_bytes)
                if not admitted:
                    continue
                # A run longer than the whole tier keeps its head here, the rest goes on down.
                take = min(len(todo), self.tiers[t].capacity_slots)
                extents = None
                for _ in range(3):  # another put may take the room we made; try again
                    if not self._make_room(t, take):
                        # Pinned or busy chunks hold part of the tier: store what fits.
                        take = min(take, self._attainable_slots(t))
                        if take < 1 or not self._make_room(t, take):
                            break
                    extents = self.tiers[t].allocate(take)
                    if extents is not None:
                        break
                if extents is None:
                    continue
                s, f = self._write_new(t, extents, todo[:take], view, value_bytes)
                stored += s
                failed += f
                todo = todo[take:]
            rejected = len(todo)
        finally:
            with self._lock:
                self._pending.difference_update(k for _, k in fresh)
                self._c["put_chunks"] += stored
                self._c["put_rejected"] += len(fresh) - stored - failed
        return PutResult(stored, len(keys) - len(fresh), rejected, failed)

    def _write_new(
        self,
        t: int,
        extents: list[Extent],
        items: list[tuple[int, ChunkKey]],
        view: memoryview,
        value_bytes: int,
    ) -> tuple[int, int]:
        tier = self.tiers[t]
        stored = failed = 0
        pos = 0
        indexed: list[tuple[ChunkKey, int]] = []
        for ext in extents:
            offset, n = ext.offset, ext.units
            chunk = items[pos : pos + n]
            pos += n
            # Values in one extent are written with one copy when they are contiguous
            # in the caller's buffer, which they are for a sequence's new chunks.
            groups = _contiguous_groups(chunk)
            slot = offset
            done: list[tuple[ChunkKey, int]] = []
            try:
                for start_idx, ks in groups:
                    run = SlotRun(slot, tuple(ks), value_bytes)
                    src = view[start_idx * value_bytes : (start_idx + len(ks)) * value_bytes]
                    tier.write(run, src)
                    done.extend((k, slot + j) for j, k in enumerate(ks))
                    slot += len(ks)
            except TierError as exc:
                self._tier_failed(t, "write", exc, n)
                tier.release(offset, n)
                failed += n
                continue
            indexed.extend(done)
            stored += n
        with self._lock:
            # Newest-last in eviction order, tail first: a sequence loses its tail
            # before its head, so what stays is still a usable prefix.
            for key, slot_no in reversed(indexed):
                self._index[key] = _Entry(_Slot(key, t, slot_no, value_bytes))
                self._evict[t].insert(key, value_bytes)
        if stored:
            self._emit(StoreEvent(EventKind.STORED, tier.name, stored, stored * value_bytes))
        return stored, failed

    def _get(self, slots: list[_Slot], view: memoryview, tail: list[ChunkKey]) -> GetResult:
        if tail:
            room = view.nbytes - sum(sl.value_bytes for sl in slots)
            slots = slots + self._adopt(tail, hold=True, max_bytes=room)
        done = 0
        pos = 0
        tiers: list[str] = []
        lengths: list[int] = []
        try:
            for first, t, run in runs_of(slots):
                try:
                    self.tiers[t].read(run, view[pos : pos + run.nbytes])
                except TierError as exc:
                    self._read_failed(t, slots[first : first + run.n], exc)
                    break
                done = first + run.n
                pos += run.nbytes
                tiers.extend([self.tiers[t].name] * run.n)
                lengths.extend([run.value_bytes] * run.n)
        finally:
            self._unread(slots)
        served = slots[:done]
        by_tier: dict[int, list[ChunkKey]] = {}
        with self._lock:
            self._c["get_chunks"] += done
            self._c["get_bytes"] += pos
            for sl in served:
                self._tier_hits[sl.tier] += 1
                by_tier.setdefault(sl.tier, []).append(sl.key)
            for t, ks in by_tier.items():
                self.placement.on_hit(t, ks)
        if self.promote_on_hit and not self._closed:
            for t, ks in by_tier.items():
                if t > 0 and self.placement.should_promote(t, ks):
                    self._submit(self._promote, ks)
        return GetResult(done, pos, tuple(lengths), tuple(tiers))

    def _promote(self, keys: list[ChunkKey]) -> None:
        # Never more than half the top tier at once: a promotion must not flush the
        # whole working set of the top tier for one long sequence.
        limit = max(1, self.tiers[0].capacity_slots // 2)
        with self._lock:
            movable = self._claim_movers_locked(keys[:limit], lambda e: e.slot.tier > 0)
        if not movable:
            return
        if not self._make_room(0, len(movable)):
            with self._lock:
                self._release_movers_locked(movable)
            return
        moved = self._move(movable, 0, drop_on_failure=False)
        with self._lock:
            self._c["promoted_chunks"] += moved
        if moved:
            self._emit(StoreEvent(EventKind.PROMOTED, self.tiers[0].name, moved, 0))

    # -- shared tiers --------------------------------------------------------------------

    def _adopt(
        self, keys: Sequence[ChunkKey], *, hold: bool = False, max_bytes: int | None = None
    ) -> list[_Slot]:
        """Index the leading ``keys`` that shared tiers hold but this index lacks.

        Another process may have stored them. Each shared tier, in order, is probed for
        what is still missing; each chunk found claims one slot of that tier (its
        allocator is a logical bound there) and is then read through the normal path. A
        chunk that vanishes before it is read fails that read, which is a miss. Called
        with no lock held (probes do I/O). Returns the slots of the leading run, in key
        order, read-held when ``hold``; at most ``max_bytes`` of values.
        """
        out: list[_Slot] = []
        rest = list(keys)
        room = max_bytes
        for t in self._shared:
            if not rest:
                break
            tier = self.tiers[t]
            lengths: list[int] = []
            for length in list(tier.probe(rest))[: len(rest)]:
                if not 0 < length <= min(tier.slot_bytes, self.slot_bytes):
                    break
                if room is not None:
                    if length > room:
                        break
                    room -= length
                lengths.append(length)
            n = min(len(lengths), tier.capacity_slots)
            if not n:
                continue
            if not self._make_room(t, n):
                break
            extents = tier.allocate(n)
            if extents is None:
                break
            offsets = [o for ext in extents for o in range(ext.offset, ext.offset + ext.units)]
            new: list[ChunkKey] = []
            with self._lock:
                for j in range(n):
                    key = rest[j]
                    e = self._index.get(key)
                    if e is None:
                        e = self._index[key] = _Entry(_Slot(key, t, offsets[j], lengths[j]))
                        new.append(key)
                    else:  # indexed meanwhile by a put or another adoption
                        tier.release(offsets[j], 1)
                    if hold:
                        e.slot.readers += 1
                    out.append(e.slot)
                for key in reversed(new):  # head most recent, as in _write_new
                    self._evict[t].insert(key, self._index[key].slot.value_bytes)
                self._c["adopted_chunks"] += len(new)
            rest = rest[n:]
            if n < len(lengths):
                break
        return out

    # -- making room ---------------------------------------------------------------------

    def _make_room(self, t: int, n: int) -> bool:
        """Ensure tier ``t`` has ``n`` free slots, demoting or dropping victims. No lock held."""
        tier = self.tiers[t]
        if n > tier.capacity_slots:
            return False
        for _ in range(_MAKE_ROOM_ROUNDS):
            with self._lock:
                deficit = n - tier.free_slots
                if deficit <= 0:
                    return True
                victims = self._pick_victims_locked(t, deficit)
                if len(victims) < deficit:
                    # Not enough evictable chunks: change nothing (atomic eviction).
                    self._release_movers_locked(victims)
                    return False
                target = self.placement.demote_target(t, len(self.tiers), [v.key for v in victims])
                if target is None:
                    self._drop_movers_locked(t, victims)
                    continue
            if self._make_room(target, len(victims)):
                moved = self._move(victims, target, drop_on_failure=True)
                with self._lock:
                    self._c["demoted_chunks"] += moved
                if moved:
                    self._emit(StoreEvent(EventKind.DEMOTED, self.tiers[target].name, moved, 0))
            else:
                with self._lock:
                    self._drop_movers_locked(t, victims)
        return tier.free_slots >= n

    def _attainable_slots(self, t: int) -> int:
        """Free slots of tier ``t`` plus those its evictable chunks hold."""
        with self._lock:
            evictable = sum(
                1
                for e in self._index.values()
                if e.slot.tier == t and not (e.pins or e.moving or e.slot.readers)
            )
            return self.tiers[t].free_slots + evictable

    def _pick_victims_locked(self, t: int, deficit: int) -> list[_Slot]:
        keys: list[ChunkKey] = []
        for key in self._evict[t].candidates():
            e = self._index.get(key)
            if e is None or e.pins or e.moving or e.slot.readers or e.slot.tier != t:
                continue
            keys.append(key)
            if len(keys) >= deficit:
                break
        return self._claim_movers_locked(keys, lambda e: True)

    def _claim_movers_locked(
        self, keys: Sequence[ChunkKey], ok: Callable[[_Entry], bool]
    ) -> list[_Slot]:
        """Mark chunks as moving (so no other mover takes them) and read-hold their slots."""
        out: list[_Slot] = []
        for key in keys:
            e = self._index.get(key)
            if e is None or e.moving or not ok(e):
                continue
            e.moving = True
            e.slot.readers += 1
            out.append(e.slot)
        return out

    def _release_movers_locked(self, slots: list[_Slot]) -> None:
        for sl in slots:
            e = self._index.get(sl.key)
            if e is not None and e.slot is sl:
                e.moving = False
            self._unread_locked(sl)

    def _drop_movers_locked(self, t: int, victims: list[_Slot]) -> None:
        self._release_movers_locked(victims)
        dropped = 0
        for sl in victims:
            e = self._index.get(sl.key)
            if e is not None and e.slot is sl:
                self._remove_locked(sl.key, e)
                dropped += 1
        self._c["dropped_chunks"] += dropped
        self._emit(StoreEvent(EventKind.DROPPED, self.tiers[t].name, dropped, 0))

    def _move(self, victims: list[_Slot], target: int, *, drop_on_failure: bool) -> int:
        """Copy moving chunks into ``target`` (room already made) and repoint the index.

        Returns how many moved. A chunk that fails to move is dropped when it is a
        victim that must leave its tier (``drop_on_failure``), and stays where it was
        otherwise (a promotion). The old copy is released only when its last reader is
        done, so concurrent gets of these chunks still read intact bytes.
        """
        victims = sorted(victims, key=lambda v: (v.tier, v.offset))
        dst_tier = self.tiers[target]
        extents = dst_tier.allocate(len(victims))
        if extents is None:
            with self._lock:
                if drop_on_failure:
                    self._drop_movers_locked(victims[0].tier, victims)
                else:
                    self._release_movers_locked(victims)
            return 0
        offsets = [o for ext in extents for o in range(ext.offset, ext.offset + ext.units)]
        starts: list[int] = []
        pos = 0
        for v in victims:
            starts.append(pos)
            pos += v.value_bytes
        staging = np.empty(pos, dtype=np.uint8)
        view = memoryview(staging.data)
        ok = [False] * len(victims)
        for first, t, run in runs_of(victims):
            lo = starts[first]
            try:
                self.tiers[t].read(run, view[lo : lo + run.nbytes])
            except TierError as exc:
                self._read_failed(t, victims[first : first + run.n], exc)
                continue
            for j in range(run.n):
                ok[first + j] = True
        new_slots = [_Slot(v.key, target, offsets[i], v.value_bytes) for i, v in enumerate(victims)]
        written = [False] * len(victims)
        # Write what was read into the new slots, run by run (staging is packed in
        # victim order, and new offsets follow the same order).
        good = [i for i in range(len(victims)) if ok[i]]
        for first, _, run in runs_of([new_slots[i] for i in good]):
            idx = good[first : first + run.n]
            contiguous = all(
                starts[i] == starts[idx[0]] + j * run.value_bytes for j, i in enumerate(idx)
            )
            try:
                if contiguous:
                    lo = starts[idx[0]]
                    dst_tier.write(run, view[lo : lo + run.nbytes])
                else:
                    for j, i in enumerate(idx):
                        one = SlotRun(run.offset + j, (run.keys[j],), run.value_bytes)
                        dst_tier.write(one, view[starts[i] : starts[i] + run.value_bytes])
            except TierError as exc:
                self._tier_failed(target, "write", exc, run.n)
                continue
            for i in idx:
                written[i] = True
        moved = 0
        with self._lock:
            for i, old in enumerate(victims):
                e = self._index.get(old.key)
                current = e is not None and e.slot is old
                if current and written[i]:
                    assert e is not None
                    self._evict[old.tier].remove(old.key)
                    e.slot = new_slots[i]
                    e.moving = False
                    self._evict[target].insert(old.key, old.value_bytes)
                    self._retire_locked(old)
                    moved += 1
                else:
                    dst_tier.release(new_slots[i].offset, 1)
                    if current and drop_on_failure:
                        assert e is not None
                        e.moving = False
                        self._remove_locked(old.key, e)
                        self._c["dropped_chunks"] += 1
                    elif current:
                        assert e is not None
                        e.moving = False
                self._unread_locked(old)
        return moved

    # -- index helpers (lock held) --------------------------------------------------------

    def _remove_locked(self, key: ChunkKey, e: _Entry) -> None:
        """Take a chunk out of the index; its bytes go when the last reader is done."""
        del self._index[key]
        self._evict[e.slot.tier].remove(key)
        self._retire_locked(e.slot)

    def _retire_locked(self, sl: _Slot) -> None:
        sl.retired = True
        if sl.readers == 0:
            self._free_slot_locked(sl)

    def _unread_locked(self, sl: _Slot) -> None:
        sl.readers -= 1
        if sl.retired and sl.readers == 0:
            self._free_slot_locked(sl)

    def _free_slot_locked(self, sl: _Slot) -> None:
        tier = self.tiers[sl.tier]
        tier.forget(SlotRun(sl.offset, (sl.key,), sl.value_bytes))
        tier.release(sl.offset, 1)

    def _unread(self, slots: list[_Slot]) -> None:
        with self._lock:
            for sl in slots:
                self._unread_locked(sl)

    # -- failures ------------------------------------------------------------------------

    def _read_failed(self, t: int, slots: list[_Slot], exc: TierError) -> None:
        corrupt = isinstance(exc, CorruptChunkError)
        n = len(slots)
        self._tier_failed(t, "read", exc, n)
        # A chunk that failed to read is never served again: it becomes a miss.
        with self._lock:
            for sl in slots:
                e = self._index.get(sl.key)
                if e is not None and e.slot is sl:
                    self._remove_locked(sl.key, e)
            if corrupt:
                self._c["corrupt_chunks"] += n
        if corrupt:
            nbytes = sum(sl.value_bytes for sl in slots)
            self._emit(StoreEvent(EventKind.CORRUPT, self.tiers[t].name, n, nbytes, str(exc)))

    def _tier_failed(self, t: int, op: str, exc: TierError, n: int) -> None:
        name = self.tiers[t].name
        with self._lock:
            self._c["tier_errors"] += 1
            seen = self._logged.get((name, op), 0)
            self._logged[(name, op)] = seen + 1
        # Log the first failure of each kind, then one in a thousand: a dying disk must
        # not flood the engine's log.
        if seen % 1000 == 0:
            log.warning(
                "tier %s %s failed for %d chunk(s), served as a miss (%d so far): %s",
                name,
                op,
                n,
                seen + 1,
                exc,
            )
        self._emit(StoreEvent(EventKind.TIER_ERROR, name, n, 0, f"{op}: {exc}"))

    def _emit(self, event: StoreEvent) -> None:
        for listener in self._listeners:
            try:
                listener(event)
            except Exception:  # a listener's bug must not break a store operation
                log.exception("store listener failed on %s", event.kind.value)

    def _check_open(self) -> None:
        if self._closed:
            raise ClosedError("the store is closed")

    def _recover(self) -> None:
        for t, tier in enumerate(self.tiers):
            recovered = 0
            for run in tier.recover():
                for j, key in enumerate(run.keys):
                    slot = _Slot(key, t, run.offset + j, run.value_bytes)
                    if key in self._index:  # a copy in a higher tier wins
                        self._free_slot_locked(slot)
                        continue
                    self._index[key] = _Entry(slot)
                    self._evict[t].insert(key, run.value_bytes)
                    recovered += 1
            if recovered:
                log.info("tier %s: recovered %d chunks", tier.name, recovered)


class _InlineExecutor:
    """Runs each submitted call at once on the caller's thread (``io_threads=0``)."""

    def submit(self, fn: Callable[..., T], /, *args: object) -> Future[T]:
        fut: Future[T] = Future()
        try:
            fut.set_result(fn(*args))
        except BaseException as exc:  # the caller sees it through the future, as with a pool
            fut.set_exception(exc)
        return fut

    def shutdown(self, wait: bool = True) -> None:
        pass


def _contiguous_groups(items: list[tuple[int, ChunkKey]]) -> list[tuple[int, list[ChunkKey]]]:
    """Split (index in caller buffer, key) pairs into runs of consecutive indices."""
    out: list[tuple[int, list[ChunkKey]]] = []
    for idx, key in items:
        if out and out[-1][0] + len(out[-1][1]) == idx:
            out[-1][1].append(key)
        else:
            out.append((idx, [key]))
    return out
