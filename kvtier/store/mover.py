"""The store's worker: every transfer of chunk bytes between the caller and the tiers.

The :class:`Mover` writes new chunks (``put``), reads hits (``get``), makes room by
demoting or dropping victims, promotes hits, and adopts chunks that other processes
left in shared tiers. It runs on the store's I/O threads. It changes the books
(:class:`~kvtier.store.index.StoreIndex`) only through the index's two-phase verbs, as
vLLM's offloading worker leaves the books to its manager: each transfer is prepared
(keys claimed, slots held), done with no lock held, then completed or cancelled.

Failures of a tier (I/O errors, corrupt bytes) never escape as exceptions: they become
misses, a counter, an event and a rate-limited log line.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Sequence

import numpy as np

from kvtier.alloc import Extent
from kvtier.errors import CorruptChunkError, TierError
from kvtier.keys import ChunkKey
from kvtier.store.events import Events
from kvtier.store.index import Eviction, Room, StoreIndex
from kvtier.store.quota import tag_of
from kvtier.store.slots import Slot, runs_of
from kvtier.store.types import EventKind, GetResult, PutResult, StoreEvent
from kvtier.tiers.base import SharedTier, SlotRun, ViewableTier

log = logging.getLogger(__name__)

Values = memoryview | list[memoryview]
"""The values of one put: packed in one buffer, or one buffer per key."""

Background = Callable[[Callable[[], object]], None]
"""Runs a call later on an I/O thread (background promotions); a closed store skips it."""

_MAKE_ROOM_ROUNDS = 8  # bounded retries when concurrent puts race for freed space
_PERSIST_BATCH_BYTES = 64 << 20  # staging per batch when a clean close persists chunks


def _offsets(extents: Sequence[Extent]) -> list[int]:
    return [o for ext in extents for o in range(ext.offset, ext.offset + ext.units)]


def _landing(tier: ViewableTier | None, slots: list[Slot]) -> memoryview | None:
    """New slots as one view to read into: they must be consecutive in a tier of memory."""
    if tier is None:
        return None
    first = slots[0]
    if any(sl.offset != first.offset + j for j, sl in enumerate(slots)):
        return None
    return tier.run_view(SlotRun(first.offset, tuple(sl.key for sl in slots), first.value_bytes))


def _contiguous_groups(
    items: list[tuple[int, ChunkKey]], *, packed: bool = True
) -> list[tuple[int, list[ChunkKey]]]:
    """Split (index in caller buffer, key) pairs into runs of consecutive indices
    (groups of one where the values are not ``packed`` in one buffer)."""
    out: list[tuple[int, list[ChunkKey]]] = []
    for idx, key in items:
        if packed and out and out[-1][0] + len(out[-1][1]) == idx:
            out[-1][1].append(key)
        else:
            out.append((idx, [key]))
    return out


class Mover:
    """Moves chunk bytes for one store.

    Args:
        index: the store's books; the mover changes them through its verbs.
        events: where the mover announces what it stored, moved and failed.
        promote_on_hit: move chunks hit in a lower tier back to the top, in the background.
        background: how promotions are scheduled.
    """

    def __init__(
        self,
        index: StoreIndex,
        events: Events,
        *,
        promote_on_hit: bool,
        background: Background,
    ) -> None:
        self.index = index
        self.tiers = index.tiers
        self.slot_bytes = min(t.slot_bytes for t in self.tiers)
        self.promote_on_hit = promote_on_hit
        self.emit = events.emit
        # The tiers with each capability, by position: asked once, here, by type.
        self.shared = {i: t for i, t in enumerate(self.tiers) if isinstance(t, SharedTier)}
        self.views = [t if isinstance(t, ViewableTier) else None for t in self.tiers]
        self._background = background
        self.quotas = None if index.books is None else index.books.quotas

    # -- put -------------------------------------------------------------------------------

    def put(
        self, keys: list[ChunkKey], view: Values, value_bytes: int, prefix: list[ChunkKey]
    ) -> PutResult:
        """Store the new ``keys`` (values in ``view``), protecting ``prefix``."""
        if not prefix:
            return self._put_tenants(keys, view, value_bytes)
        held = self.index.pin(prefix)
        try:
            return self._put_tenants(keys, view, value_bytes)
        finally:
            self.index.unpin(held)

    def _put_tenants(self, keys: list[ChunkKey], view: Values, value_bytes: int) -> PutResult:
        """With quotas, each tenant's run of keys is put on its own quota."""
        if self.quotas is None:
            return self._put_pinned(keys, view, value_bytes, None)
        tags = [tag_of(k) for k in keys]
        if all(tg == tags[0] for tg in tags):
            return self._put_pinned(keys, view, value_bytes, tags[0])
        out = PutResult(0, 0, 0, 0)
        i = 0
        while i < len(keys):
            j = i + 1
            while j < len(keys) and tags[j] == tags[i]:
                j += 1
            part = (
                view[i * value_bytes : j * value_bytes]
                if isinstance(view, memoryview)
                else view[i:j]
            )
            r = self._put_pinned(keys[i:j], part, value_bytes, tags[i])
            out = PutResult(
                out.stored + r.stored,
                out.present + r.present,
                out.rejected + r.rejected,
                out.failed + r.failed,
            )
            i = j
        return out

    def _put_pinned(
        self, keys: list[ChunkKey], view: Values, value_bytes: int, tag: int | None
    ) -> PutResult:
        fresh = self.index.prepare_store(keys)
        stored = failed = 0
        try:
            todo = fresh
            for t in range(len(self.tiers)):
                if not todo:
                    break
                todo_keys = [k for _, k in todo]
                if not self.index.admit(t, todo_keys, value_bytes):
                    continue
                # A run longer than the whole tier keeps its head here, the rest goes on down.
                take = min(len(todo), self.tiers[t].capacity_slots)
                quota = 0  # bytes reserved in the tenant's quota, given back below
                if tag is not None:
                    limit = self.quotas.limit(tag, t) if self.quotas is not None else None
                    if limit is not None:
                        slot = self.tiers[t].slot_bytes  # what a chunk is charged
                        take = min(take, limit // slot)  # so is one over the quota
                        if take < 1 or not self.quota_room(t, tag, take * slot):
                            continue
                        quota = take * slot
                try:
                    stored, failed, todo = self._put_tier(
                        t, take, todo, view, value_bytes, stored, failed
                    )
                finally:
                    if tag is not None and quota:
                        self._release(t, tag, quota)
            rejected = len(todo)
        finally:
            self.index.complete_store(fresh, stored, failed)
        return PutResult(stored, len(keys) - len(fresh), rejected, failed)

    def _put_tier(
        self,
        t: int,
        take: int,
        todo: list[tuple[int, ChunkKey]],
        view: Values,
        value_bytes: int,
        stored: int,
        failed: int,
    ) -> tuple[int, int, list[tuple[int, ChunkKey]]]:
        """Write the first ``take`` of ``todo`` into tier ``t``, making room; returns the
        counts and what is left to place."""
        extents = None
        for _ in range(3):  # another put may take the room we made; try again
            if not self.make_room(t, take):
                # Pinned or busy chunks hold part of the tier: store what fits.
                take = min(take, self.index.evictable_slots(t))
                if take < 1 or not self.make_room(t, take):
                    break
            extents = self.tiers[t].allocate(take)
            if extents is not None:
                break
        if extents is None:
            return stored, failed, todo
        s, f = self._write_new(t, extents, todo[:take], view, value_bytes)
        return stored + s, failed + f, todo[take:]

    def _write_new(
        self,
        t: int,
        extents: list[Extent],
        items: list[tuple[int, ChunkKey]],
        view: Values,
        value_bytes: int,
    ) -> tuple[int, int]:
        tier = self.tiers[t]
        stored = failed = 0
        pos = 0
        written: list[tuple[ChunkKey, int]] = []
        for ext in extents:
            offset, n = ext.offset, ext.units
            chunk = items[pos : pos + n]
            pos += n
            # Values in one extent are written with one copy when they are contiguous
            # in the caller's buffer, which they are for a sequence's new chunks.
            slot = offset
            done: list[tuple[ChunkKey, int]] = []
            try:
                for start_idx, ks in _contiguous_groups(chunk, packed=isinstance(view, memoryview)):
                    run = SlotRun(slot, tuple(ks), value_bytes)
                    if isinstance(view, memoryview):
                        src = view[start_idx * value_bytes : (start_idx + len(ks)) * value_bytes]
                    else:
                        src = view[start_idx]  # one buffer per key: groups of one
                    tier.write(run, src)
                    done.extend((k, slot + j) for j, k in enumerate(ks))
                    slot += len(ks)
            except TierError as exc:
                self.tier_failed(t, "write", exc, n)
                tier.release(offset, n)
                failed += n
                continue
            written.extend(done)
            stored += n
        self.index.add_stored(t, written, value_bytes)
        if stored:
            self.emit(StoreEvent(EventKind.STORED, tier.name, stored, stored * value_bytes))
        return stored, failed

    def complete_reserved(self, t: int, key: ChunkKey, slot_no: int, value_bytes: int) -> None:
        """Index one chunk the caller wrote in place into slot ``slot_no`` of tier ``t``
        (after :meth:`StoreIndex.prepare_store_one`), and count and announce its put."""
        tier = self.tiers[t]
        tier.note_written(value_bytes)
        self.index.complete_store_one(t, key, slot_no, value_bytes)
        if self.quotas is not None:
            self._release(t, tag_of(key), tier.slot_bytes)
        self.emit(StoreEvent(EventKind.STORED, tier.name, 1, value_bytes))

    def cancel_reserved(self, t: int, key: ChunkKey, slot_no: int) -> None:
        """Give back a reserved slot that was not filled; its key stays absent."""
        self.tiers[t].release(slot_no, 1)
        self.index.cancel_store_one(key)
        if self.quotas is not None:
            self._release(t, tag_of(key), self.tiers[t].slot_bytes)

    # -- get -------------------------------------------------------------------------------

    def get(self, slots: list[Slot], view: memoryview, tail: list[ChunkKey]) -> GetResult:
        """Read the held ``slots`` into ``view``, then what shared tiers hold of ``tail``."""
        if tail:
            room = view.nbytes - sum(sl.value_bytes for sl in slots)
            slots = slots + self.adopt(tail, hold=True, max_bytes=room)
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
        except BaseException:
            self.index.unread(slots)
            raise
        self._promote_later(self.index.complete_load(slots, done, pos, promote=self.promote_on_hit))
        return GetResult(done, pos, tuple(lengths), tuple(tiers))

    def complete_hold(self, slot: Slot) -> None:
        """End a hold of one slot whose value the caller read in place: count it as a
        get served from its tier (hits, placement, promotion, tier reads)."""
        promote = self.index.complete_load([slot], 1, slot.value_bytes, promote=self.promote_on_hit)
        self._promote_later(promote)
        self.tiers[slot.tier].count_read(slot.value_bytes)

    def _promote_later(self, batches: list[list[ChunkKey]]) -> None:
        for ks in batches:
            self._background(functools.partial(self._promote, ks))

    def _promote(self, keys: list[ChunkKey]) -> None:
        # Never more than half the top tier at once: a promotion must not flush the
        # whole working set of the top tier for one long sequence.
        limit = max(1, self.tiers[0].capacity_slots // 2)
        movable = self.index.prepare_move(keys[:limit], range(1, len(self.tiers)))
        if not movable:
            return
        reserved: list[tuple[int, int]] = []
        if self.quotas is not None:
            movable, reserved = self._fit_quotas(0, movable, self.index.cancel_move)
        try:
            if not movable:
                return
            if not self.make_room(0, len(movable)):
                self.index.cancel_move(movable)
                return
            moved = self._move(movable, 0, drop_on_failure=False)
            if moved:
                self.emit(StoreEvent(EventKind.PROMOTED, self.tiers[0].name, moved, 0))
        finally:
            for tag, nbytes in reserved:
                self._release(0, tag, nbytes)

    def _release(self, t: int, tag: int, nbytes: int) -> None:
        if self.index.books is not None:
            self.index.books.release(t, tag, nbytes)

    # -- shared tiers ----------------------------------------------------------------------

    def adopt(
        self, keys: Sequence[ChunkKey], *, hold: bool = False, max_bytes: int | None = None
    ) -> list[Slot]:
        """Index the leading ``keys`` that shared tiers hold but this index lacks.

        Another process may have stored them. Each shared tier, in order, is probed for
        what is still missing; each chunk found claims one slot of that tier (its
        allocator is a logical bound there) and is then read through the normal path. A
        chunk that vanishes before it is read fails that read, which is a miss. Called
        with no lock held (probes do I/O). Returns the slots of the leading run, in key
        order, read-held when ``hold``; at most ``max_bytes`` of values.
        """
        out: list[Slot] = []
        rest = list(keys)
        room = max_bytes
        for t, tier in self.shared.items():
            if not rest:
                break
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
            if not self.make_room(t, n):
                break
            extents = tier.allocate(n)
            if extents is None:
                break
            out += self.index.add_adopted(t, rest[:n], _offsets(extents), lengths[:n], hold=hold)
            rest = rest[n:]
            if n < len(lengths):
                break
        return out

    # -- making room -----------------------------------------------------------------------

    def make_room(self, t: int, n: int) -> bool:
        """Ensure tier ``t`` has ``n`` free slots, demoting or dropping victims. No lock held."""
        tier = self.tiers[t]
        if n > tier.capacity_slots:
            return False
        done = self._evict_rounds(t, lambda: self.index.prepare_eviction(t, n))
        return tier.free_slots >= n if done is None else done

    def quota_room(self, t: int, tag: int, nbytes: int) -> bool:
        """Make ``nbytes`` fit in tenant ``tag``'s quota in tier ``t`` by demoting or
        dropping its own coldest chunks there, and reserve them (give them back with
        :meth:`StoreIndex.release_quota`). False, reserving nothing, when they cannot fit.
        No lock held."""
        return bool(self._evict_rounds(t, lambda: self.index.prepare_quota(t, tag, nbytes)))

    def _evict_rounds(self, t: int, prepare: Callable[[], Room | Eviction]) -> bool | None:
        """Rounds of ``prepare`` (an index verb that claims victims in tier ``t``), each
        claim demoted: True once there is room, False when there cannot be, None when
        the rounds ran out (other threads kept taking the room)."""
        for _ in range(_MAKE_ROOM_ROUNDS):
            ev = prepare()
            if ev is Room.FREE:
                return True
            if ev is Room.SHORT:
                return False
            if ev is not Room.DROPPED:
                self._demote(t, ev)
        return None

    def _demote(self, t: int, ev: Eviction) -> None:
        """Move the victims of tier ``t`` claimed by ``ev`` down to its target, each
        within its tenant's quota there (those that do not fit are dropped)."""
        victims, reserved = self._fit_quotas(
            ev.target, list(ev.victims), functools.partial(self.index.drop_moves, t)
        )
        try:
            if not victims:
                return
            if self.make_room(ev.target, len(victims)):
                moved = self._move(victims, ev.target, drop_on_failure=True)
                if moved:
                    self.emit(StoreEvent(EventKind.DEMOTED, self.tiers[ev.target].name, moved, 0))
            else:
                self.index.drop_moves(t, victims)
        finally:
            for tag, nbytes in reserved:
                self._release(ev.target, tag, nbytes)

    def _fit_quotas(
        self, target: int, slots: list[Slot], give_up: Callable[[list[Slot]], object]
    ) -> tuple[list[Slot], list[tuple[int, int]]]:
        """The claimed ``slots`` whose tenants' quotas in tier ``target`` have room for
        them (reserved: the (tag, bytes) returned); ``give_up`` is called on the others
        (a demotion drops them, a promotion leaves them where they are)."""
        if self.quotas is None:
            return slots, []
        groups: dict[int, list[Slot]] = {}
        for sl in slots:
            groups.setdefault(tag_of(sl.key), []).append(sl)
        kept: list[Slot] = []
        reserved: list[tuple[int, int]] = []
        for tag, group in groups.items():
            nbytes = len(group) * self.tiers[target].slot_bytes
            if self.quotas.limit(tag, target) is None:
                kept += group
            elif self.quota_room(target, tag, nbytes):
                kept += group
                reserved.append((tag, nbytes))
            else:
                give_up(group)
        return kept, reserved

    def persist(self, t: int, target: int, limit: int) -> int:
        """Move tier ``t``'s chunks down into persistent tier ``target`` (a clean close).

        The ``limit`` most recently used go, coldest of them first, so the target's
        eviction order keeps the hottest as the newest. Room is made in the target as for
        any demotion (its coldest chunks go down or are dropped, as placement says), and
        never by evicting what this call already moved (``limit`` is at most the target's
        capacity). A chunk that fails to move stays where it was. Returns how many moved.
        """
        if limit <= 0:
            return 0
        batch = max(1, _PERSIST_BATCH_BYTES // self.tiers[t].slot_bytes)
        keys = self.index.hottest(t)[:limit]
        keys.reverse()
        if keys:
            # Said before the move, which runs at disk speed: an operator whose service
            # manager stops the daemon sees why the stop takes time (docs/operations.md).
            log.info(
                "tier %s: moving %d chunk(s) (%.1f MiB) into %s before closing",
                self.tiers[t].name,
                len(keys),
                len(keys) * self.tiers[t].slot_bytes / (1 << 20),
                self.tiers[target].name,
            )
        moved = 0
        for lo in range(0, len(keys), batch):
            claimed = self.index.prepare_move(keys[lo : lo + batch], range(t, t + 1))
            if not claimed:
                continue
            if not self.make_room(target, len(claimed)):
                self.index.cancel_move(claimed)
                break
            moved += self._move(claimed, target, drop_on_failure=False)
        if moved:
            self.emit(StoreEvent(EventKind.DEMOTED, self.tiers[target].name, moved, 0))
        return moved

    def _move(self, victims: list[Slot], target: int, *, drop_on_failure: bool) -> int:
        """Copy chunks claimed for a move into ``target`` (room already made), then
        complete the move in the index.

        Returns how many moved. A chunk that fails to move is dropped when it is a
        victim that must leave its tier (``drop_on_failure``), and stays where it was
        otherwise (a promotion). The old copy is released only when its last reader is
        done, so concurrent gets of these chunks still read intact bytes.
        """
        victims = sorted(victims, key=lambda v: (v.tier, v.offset))
        dst_tier = self.tiers[target]
        extents = dst_tier.allocate(len(victims))
        if extents is None:
            if drop_on_failure:
                self.index.drop_moves(victims[0].tier, victims)
            else:
                self.index.cancel_move(victims)
            return 0
        offsets = _offsets(extents)
        new_slots = [
            self.index.new_slot(v.key, target, offsets[i], v.value_bytes)
            for i, v in enumerate(victims)
        ]
        written = [False] * len(victims)
        bufs, where = self._gather(victims, new_slots, written)
        # Write the new slots run by run: one write where the run's bytes lie back to
        # back in one buffer (new offsets follow the victims' order), else chunk by chunk.
        good = [i for i in range(len(victims)) if where[i][0] >= 0]
        for first, _, run in runs_of([new_slots[i] for i in good]):
            idx = good[first : first + run.n]
            b, lo = where[idx[0]]
            contiguous = all(where[i] == (b, lo + j * run.value_bytes) for j, i in enumerate(idx))
            try:
                if contiguous:
                    dst_tier.write(run, bufs[b][lo : lo + run.nbytes])
                else:
                    for j, i in enumerate(idx):
                        one = SlotRun(run.offset + j, (run.keys[j],), run.value_bytes)
                        bi, at = where[i]
                        dst_tier.write(one, bufs[bi][at : at + run.value_bytes])
            except TierError as exc:
                self.tier_failed(target, "write", exc, run.n)
                continue
            for i in idx:
                written[i] = True
        return self.index.complete_move(victims, new_slots, written, drop=drop_on_failure)

    def _gather(
        self, victims: list[Slot], new_slots: list[Slot], written: list[bool]
    ) -> tuple[list[memoryview], list[tuple[int, int]]]:
        """Where each victim's bytes are to be written from: ``(buffer, start)`` in the
        returned buffers; ``(-1, 0)`` for a victim whose read failed or that already lies
        in its new slot (``written[i]`` set).

        A source tier of plain memory is written from in place (the victims are
        read-held, so their slots stay intact until the repoint): a full host tier
        demotes into nvme with no staging copy. A source behind I/O reads straight into
        the new slots where they are one run of a tier of plain memory (a promotion from
        nvme into the host tier). Anything else is read into one staging buffer.
        """
        dst_views = self.views[new_slots[0].tier]
        bufs: list[memoryview] = []
        where: list[tuple[int, int]] = [(-1, 0)] * len(victims)
        staged: list[tuple[int, int, SlotRun]] = []
        for first, t, run in runs_of(victims):
            src = self.tiers[t]
            src_views = self.views[t]
            in_place = src_views.run_view(run) if src_views is not None else None
            if in_place is not None:
                src.count_read(run.nbytes)
                bufs.append(in_place)
                for j in range(run.n):
                    where[first + j] = (len(bufs) - 1, j * run.value_bytes)
                continue
            landing = _landing(dst_views, new_slots[first : first + run.n])
            if landing is None:
                staged.append((first, t, run))
                continue
            try:
                src.read(run, landing)
            except TierError as exc:
                self._read_failed(t, victims[first : first + run.n], exc)
                continue
            self.tiers[new_slots[0].tier].note_written(run.nbytes)
            for j in range(run.n):
                written[first + j] = True
        if staged:
            staging = memoryview(
                np.empty(sum(run.nbytes for _, _, run in staged), dtype=np.uint8).data
            )
            bufs.append(staging)
            pos = 0
            for first, t, run in staged:
                try:
                    self.tiers[t].read(run, staging[pos : pos + run.nbytes])
                except TierError as exc:
                    self._read_failed(t, victims[first : first + run.n], exc)
                else:
                    for j in range(run.n):
                        where[first + j] = (len(bufs) - 1, pos + j * run.value_bytes)
                pos += run.nbytes
        return bufs, where

    # -- failures and events ---------------------------------------------------------------

    def _read_failed(self, t: int, slots: list[Slot], exc: TierError) -> None:
        corrupt = isinstance(exc, CorruptChunkError)
        self.tier_failed(t, "read", exc, len(slots))
        self.index.forget_failed(slots, corrupt=corrupt)
        if corrupt:
            nbytes = sum(sl.value_bytes for sl in slots)
            self.emit(
                StoreEvent(EventKind.CORRUPT, self.tiers[t].name, len(slots), nbytes, str(exc))
            )

    def tier_failed(self, t: int, op: str, exc: TierError, n: int) -> None:
        """Count, log (rate-limited) and announce a failure of tier ``t``'s ``op``."""
        name = self.tiers[t].name
        seen = self.index.note_failure(name, op)
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
        self.emit(StoreEvent(EventKind.TIER_ERROR, name, n, 0, f"{op}: {exc}"))
