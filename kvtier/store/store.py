"""The tiered store: one index over a stack of tiers, and the mover between them.

* ``put`` writes new chunks into the top tier the placement policy admits, laying each
  run out as adaptive extents (binary decomposition), after making room by demoting or
  dropping victims chosen by the tier's eviction policy.
* ``lookup`` answers how many leading chunks are present, and where. Cheap, no I/O,
  except that chunks missing from the index are looked for in *shared* tiers (Redis:
  other processes store there too); found ones are adopted into the index.
* ``get`` copies a leading run into the caller's buffer; a hit in a lower tier may be
  promoted afterwards, in the background.
* ``delete``, ``pin``/``unpin``, ``stats``, listeners for events (index changes carry
  their keys: :attr:`~kvtier.store.types.EventKind.INDEXED` / ``UNINDEXED``).
* ``close`` first moves what only memory tiers hold into the persistent tier below them
  (nvme), the most recently used first, up to its capacity: a clean shutdown keeps the
  cache; a crash keeps what had reached the persistent tier (its durability mode).

:class:`TieredStore` is a facade over two parts, as vLLM's offloading keeps a manager
apart from its worker: :class:`~kvtier.store.index.StoreIndex` keeps the books (entries,
pins, eviction orders, counters) under one lock, and :class:`~kvtier.store.mover.Mover`
does every transfer on the store's I/O threads.

Threading: public methods may be called from any thread. Bytes move on the store's I/O
threads, never under the index lock (``put`` and ``get`` return futures); a caller
that waits on such a future before an I/O thread has begun it runs the work itself,
which saves two thread wake-ups (:mod:`kvtier.store.executor`). Every read holds the
slot it reads; a slot whose chunk moved or was deleted is released to its tier only when
its last reader is done, so no slot is reused while bytes are in flight.

Failures of a tier (I/O errors, corrupt bytes) never escape as exceptions: they become
misses, a counter, an event and a rate-limited log line.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Any, TypeVar

import numpy as np
import numpy.typing as npt

from kvtier.errors import ClosedError, InputError, NotDurableError, TierError
from kvtier.keys import ChunkKey, check_keys
from kvtier.store.events import Events, Listener
from kvtier.store.executor import INLINE, Executor, Finished, InlineExecutor, StealingExecutor
from kvtier.store.handles import HeldValue, Reservation
from kvtier.store.index import Room
from kvtier.store.mover import Mover, Values
from kvtier.store.native import make_index
from kvtier.store.policy import EvictionFactory, LRUEviction, PlacementPolicy, WriteThrough
from kvtier.store.quota import Quotas, TenantFigures, tag_of
from kvtier.store.slots import Slot
from kvtier.store.types import EventKind, GetResult, LookupResult, PutResult, StoreEvent, StoreStats
from kvtier.tiers.base import PersistentTier, SharedTier, Tier, ViewableTier

Buffer = memoryview | bytes | bytearray | npt.NDArray[Any]
T = TypeVar("T")

INLINE_MEMORY_GET_BYTES = 1 << 20
"""A get's default ``inline_memory_bytes``: a hit in memory tiers up to this size is
copied on the caller's thread, where the copy costs no more than the hand-off to an I/O
thread and back (docs/architecture.md, "The store")."""
log = logging.getLogger(__name__)


def _as_bytes_view(buf: Buffer, *, writable: bool) -> memoryview:
    if isinstance(buf, np.ndarray):
        view = buf.data  # (not buf.flags: it builds a flags object on every call)
        if not view.c_contiguous:
            raise InputError("buffer must be C-contiguous")
        if view.format != "B" or view.ndim != 1:  # a flat byte array (the usual case) is one call
            view = memoryview(buf.reshape(-1).view(np.uint8).data)
    else:
        view = memoryview(buf)
    view = view.cast("B") if view.format != "B" or view.ndim != 1 else view
    if writable and view.readonly:
        raise InputError("destination buffer is read-only")
    return view


def _values_of(
    keys: Sequence[ChunkKey], data: Buffer | list[Buffer] | tuple[Buffer, ...]
) -> tuple[Values, int]:
    """``data`` of :meth:`TieredStore.put` as the mover takes it, and the value length."""
    if isinstance(data, (list, tuple)):
        pieces = [_as_bytes_view(b, writable=False) for b in data]
        if len(pieces) != len(keys):
            raise InputError(f"{len(pieces)} buffers for {len(keys)} keys")
        value_bytes = pieces[0].nbytes if pieces else 0
        if any(p.nbytes != value_bytes for p in pieces):
            raise InputError("the buffers of one put must be of one length")
        return pieces, value_bytes
    view = _as_bytes_view(data, writable=False)
    if not keys:
        return view, 0
    if view.nbytes % len(keys):
        raise InputError(f"{view.nbytes} bytes do not split evenly into {len(keys)} chunks")
    return view, view.nbytes // len(keys)


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
        quotas: per-tenant byte limits per tier, the tenant read from each key's tag
            (:mod:`kvtier.store.quota`). A tenant over its limit in a tier makes room
            there by demoting or dropping its own coldest chunks, never another's.
    """

    def __init__(
        self,
        tiers: Sequence[Tier],
        *,
        eviction: EvictionFactory = LRUEviction,
        placement: PlacementPolicy | None = None,
        io_threads: int = 4,
        promote_on_hit: bool = True,
        quotas: Quotas | None = None,
    ) -> None:
        if not tiers:
            raise InputError("a store needs at least one tier")
        self.tiers: tuple[Tier, ...] = tuple(tiers)
        self.placement = placement or WriteThrough()
        self._events = Events()
        self._index = make_index(
            self.tiers, eviction, self.placement, self._events.emit, quotas=quotas
        )
        self.quotas = quotas
        self._mover = Mover(
            self._index,
            self._events,
            promote_on_hit=promote_on_hit,
            background=self._background,
        )
        self.slot_bytes = self._mover.slot_bytes
        self.placement.bind(self._index)
        self.promote_on_hit = promote_on_hit
        self._pool: Executor = (
            StealingExecutor(io_threads, "kvtier-io") if io_threads > 0 else InlineExecutor()
        )
        self._inflight = 0
        # Operations count themselves under the condition's own lock, taken directly:
        # ``with self._idle`` runs Condition.__enter__/__exit__ in Python, and a notify
        # with nobody in drain() runs three more calls, on every operation.
        self._idle_lock = threading.Lock()
        self._idle = threading.Condition(self._idle_lock)
        self._drainers = 0
        self._closed = False
        self._index.recover()
        # Tiers whose reads are plain memcpys (they give slot views), by position: see
        # get(). slot_view(0, 1) asks whether this instance gives views at all.
        self._views = [
            t if isinstance(t, ViewableTier) and t.slot_view(0, 1) is not None else None
            for t in self.tiers
        ]
        self._memory = [v is not None for v in self._views]

    # -- public API ----------------------------------------------------------------------

    def put(
        self,
        keys: Sequence[ChunkKey],
        data: Buffer | list[Buffer] | tuple[Buffer, ...],
        *,
        prefix: Sequence[ChunkKey] = (),
        inline: bool = False,
    ) -> Future[PutResult]:
        """Store chunks whose values lie packed in ``data`` (equal length each).

        ``data`` may instead be a list or tuple of one buffer per key (equal lengths):
        a caller whose values sit in separate buffers (LMCache's memory objects) stores
        a whole sequence in one put, so its head is placed before its tail and never
        loses the race for room to it, with no copy into one buffer first.

        ``prefix`` names the already-stored chunks that precede ``keys`` in the same
        sequence (typically the hit that ``lookup`` returned). They are protected from
        eviction while this put makes room: a sequence longer than the store would
        otherwise push out its own head, leaving every new chunk unreachable.

        ``len(data)`` must be ``len(keys) * value_bytes`` with ``value_bytes`` at most
        :attr:`slot_bytes`. The caller must keep ``data`` alive and unchanged until the
        future completes. Chunks already present are skipped. Never raises for tier
        failures: they show in :class:`PutResult` and the stats.

        ``inline`` moves the bytes on the caller's thread and returns a done future: for
        a caller that is itself a worker thread and would only wait (the daemon's
        same-host connections), it saves a hand-off to an I/O thread and back.

        Raises:
            InputError: a malformed key (not 16 bytes), or sizes that can never work.
            ClosedError: the store is closed.
        """
        self._check_open()
        keys = check_keys(keys)
        prefix = check_keys(prefix)
        values, value_bytes = _values_of(keys, data)
        if not keys:
            return Finished(PutResult(0, 0, 0, 0))
        if not 0 < value_bytes <= self.slot_bytes:
            raise InputError(f"chunk of {value_bytes} B; the store takes 1..{self.slot_bytes} B")
        return self._submit(self._mover.put, keys, values, value_bytes, prefix, inline=inline)

    def reserve(self, key: ChunkKey, value_bytes: int) -> Reservation | None:
        """A free slot for one new chunk, which the caller fills in place, then commits.

        For a caller that receives a value piece by piece (the daemon reads a request
        body straight into the tier: one copy, and no hop to an I/O thread). Runs on the
        caller's thread and never does I/O. Returns None, and changes nothing, when the
        chunk cannot be written this way; :meth:`put` then does it: the key is present
        or being put, the tier the placement admits it to offers no direct view
        (:class:`~kvtier.tiers.base.ViewableTier`: not a medium behind I/O), or that tier
        has no free slot (making room may move chunks, which is I/O).

        Until :meth:`Reservation.commit` the chunk is not indexed: lookups miss it and a
        concurrent put of the same key counts it present. The caller must end every
        reservation with ``commit`` or ``abort``: :meth:`close` waits for them.

        Raises:
            InputError: a malformed key, or a size outside ``1..slot_bytes``.
            ClosedError: the store is closed.
        """
        self._check_open()
        (key,) = check_keys([key])
        if not 0 < value_bytes <= self.slot_bytes:
            raise InputError(f"chunk of {value_bytes} B; the store takes 1..{self.slot_bytes} B")
        if not self._index.prepare_store_one(key):
            return None
        with self._idle_lock:  # counted like a queued operation: drain() and close() wait for it
            self._inflight += 1
        try:
            for t, tier in enumerate(self._views):
                if tier is None or tier.free_slots < 1:
                    break  # put() makes room, or writes through the tier
                if not self._index.admit(t, [key], value_bytes):
                    continue
                # Over its quota here, the tenant must evict its own chunks (put() does).
                tag = None if self.quotas is None else tag_of(key)
                if tag is not None and (
                    self._index.prepare_quota(t, tag, tier.slot_bytes, evict=False) is not Room.FREE
                ):
                    break
                extents = tier.allocate(1)
                view = None
                if extents is not None:
                    view = tier.slot_view(extents[0].offset, value_bytes)
                    if view is None:
                        tier.release(extents[0].offset, 1)
                if extents is None or view is None:
                    if tag is not None and self._index.books is not None:
                        self._index.books.release(t, tag, tier.slot_bytes)
                    break
                offset = extents[0].offset
                return Reservation(self._mover, self._done, key, t, offset, view)
        except BaseException:
            self._index.cancel_store_one(key)
            self._done(None)
            raise
        self._index.cancel_store_one(key)
        self._done(None)
        return None

    def lookup(self, keys: Sequence[ChunkKey]) -> LookupResult:
        """How many leading ``keys`` are present, and in which tiers. Thread-safe.

        No I/O while the index holds the whole run. Otherwise shared tiers are probed
        for the missing tail (one round trip, bounded by the tier's budget), and chunks
        found there are adopted into the index.
        """
        self._check_open()
        keys = check_keys(keys)
        slots = self._index.present_run(keys)
        if len(slots) < len(keys) and self._mover.shared:
            slots += self._mover.adopt(keys[len(slots) :])
        self._index.note_lookup(keys, slots)
        return LookupResult(
            len(slots),
            tuple(self.tiers[sl.tier].name for sl in slots),
            tuple(sl.value_bytes for sl in slots),
        )

    def get(
        self,
        keys: Sequence[ChunkKey],
        dst: Buffer,
        *,
        inline: bool = False,
        inline_memory_bytes: int = INLINE_MEMORY_GET_BYTES,
    ) -> Future[GetResult]:
        """Copy the leading present chunks of ``keys`` into ``dst``, packed.

        ``dst`` must hold at least the sum of their value lengths (``len(keys) *
        slot_bytes`` always suffices); the caller keeps it alive until the future
        completes. A chunk that fails to read ends the run: the result counts only the
        chunks before it, so the caller never uses bytes that were not verified. Chunks
        missing from the index are looked for in shared tiers on the I/O thread, as in
        :meth:`lookup`. ``inline``: as for :meth:`put`.

        ``inline_memory_bytes``: read on the caller's thread anyway (a done future) when
        the hit lies in tiers of plain memory (:class:`~kvtier.tiers.base.ViewableTier`)
        and needs at most this many bytes (default :data:`INLINE_MEMORY_GET_BYTES`; 0
        never), or is a miss with no shared tier to ask: a memcpy that short costs less
        than the hand-off to an I/O thread and back. A tier behind I/O never blocks it.
        """
        keys, view, slots, need = self._hold_for(keys, dst)
        tail = list(keys[len(slots) :]) if self._mover.shared else []
        if (
            not inline
            and not tail
            and need <= inline_memory_bytes
            and all(self._memory[sl.tier] for sl in slots)
        ):
            inline = True
        return self._submit(self._mover.get, slots, view, tail, inline=inline)

    def get_now(self, keys: Sequence[ChunkKey], dst: Buffer, *, max_bytes: int) -> GetResult | None:
        """:meth:`get` on the caller's thread when that is a memcpy, else None.

        Copies the hit now when it lies in tiers of plain memory and needs at most
        ``max_bytes``, or is a miss with no shared tier to ask (a result of 0 chunks).
        Otherwise returns None having read nothing and counted nothing, and the caller
        uses :meth:`get`. For a caller that must answer before it returns (the daemon's
        protocol, which answers a one-chunk GET without the ASGI layers).

        Raises:
            InputError: as for :meth:`get`.
            ClosedError: the store is closed.
        """
        keys, view, slots, need = self._hold_for(keys, dst)
        tail = len(slots) < len(keys) and self._mover.shared
        if tail or need > max_bytes or not all(self._memory[sl.tier] for sl in slots):
            self._index.cancel_load(slots)
            return None
        # As an inline _submit, less the future (a Condition each) the caller never sees.
        with self._idle_lock:
            self._inflight += 1
        try:
            return self._mover.get(slots, view, [])
        finally:
            self._done(None)

    def hold_value(self, key: ChunkKey, *, max_bytes: int) -> HeldValue | None:
        """One chunk's value in place, in a tier of plain memory, held until released.

        The hold keeps the slot from being evicted, moved or reused until
        :meth:`HeldValue.release`, which also counts the get (hits, placement, tier
        reads) as :meth:`get` does. None, having held and counted nothing, when the chunk
        is absent, lies behind I/O, or is over ``max_bytes``. For a caller that sends a
        value straight from the tier (the daemon's protocol answering a GET): one copy
        fewer than :meth:`get`.

        Raises:
            InputError: a malformed key.
            ClosedError: the store is closed.
        """
        self._check_open()
        (key,) = check_keys([key])
        slots = self._index.prepare_load([key])
        view = None
        if slots and slots[0].value_bytes <= max_bytes:
            tier = self._views[slots[0].tier]
            if tier is not None:
                view = tier.slot_view(slots[0].offset, slots[0].value_bytes)
        if view is None:
            self._index.cancel_load(slots)
            return None
        with self._idle_lock:  # counted like a queued operation: drain() and close() wait for it
            self._inflight += 1
        return HeldValue(self._mover, self._done, slots[0], view)

    def _hold_for(
        self, keys: Sequence[ChunkKey], dst: Buffer
    ) -> tuple[list[ChunkKey], memoryview, list[Slot], int]:
        """A get's checked keys, destination view, held leading hits and their bytes."""
        self._check_open()
        checked = check_keys(keys)
        view = _as_bytes_view(dst, writable=True)
        slots = self._index.prepare_load(checked)
        need = sum(sl.value_bytes for sl in slots)
        if need > view.nbytes:
            self._index.unread(slots)
            raise InputError(f"destination of {view.nbytes} B; the hit needs {need} B")
        return checked, view, slots, need

    def quota_use(self) -> dict[tuple[str, str], int]:
        """Bytes each tenant's chunks take per tier (a slot each), as {(tenant, tier
        name): bytes}:
        a named tenant by its name, another by its tag in hex. Empty without quotas.
        Thread-safe."""
        if self.quotas is None or self._index.books is None:
            return {}
        return {
            (self.quotas.name(tag), self.tiers[t].name): n
            for (tag, t), n in self._index.books.use().items()
        }

    def tenant_figures(self) -> tuple[TenantFigures, ...]:
        """Per-tenant, per-tier figures (:class:`~kvtier.store.quota.TenantFigures`);
        empty without quotas (keys then carry no tenant). Thread-safe."""
        return () if self._index.books is None else self._index.books.figures_now()

    def delete(self, keys: Sequence[ChunkKey]) -> int:
        """Remove chunks; returns how many were present. Reads in flight finish first.

        Shared tiers delete the values from their medium too (one round trip each), so
        other processes stop finding them; chunks only there count as present.
        Persistent tiers make the deletion durable as their durability mode promises for
        writes (``sync``: before this returns).

        Raises:
            NotDurableError: the chunks are gone from this process, but a persistent
                tier could not make that durable (a full disk); after a restart they may
                come back. The tier keeps trying; a retry answers once it succeeds.
        """
        self._check_open()
        keys = check_keys(keys)
        gone = self._index.remove(keys)
        removed = len(gone)
        if self._mover.shared:
            # Evictions leave shared values alone (others may use them); delete must not.
            known = set(gone)
            elsewhere = [k for k in keys if k not in known]
            found_elsewhere = 0
            for shared in self._mover.shared.values():
                if gone:
                    shared.discard(gone)
                if elsewhere:
                    found_elsewhere = max(found_elsewhere, shared.discard(elsewhere))
            removed += found_elsewhere
        self._index.note_deleted(removed)
        if removed:
            self._events.emit(StoreEvent(EventKind.DELETED, "", removed, 0))
        for i, tier in enumerate(self.tiers):
            if not isinstance(tier, PersistentTier):
                continue
            # Also when nothing was removed now: a retried delete learns whether the
            # first one's records have reached the disk since.
            try:
                tier.commit_forgets()
            except TierError as exc:
                self._mover.tier_failed(i, "delete", exc, removed)
                raise NotDurableError(
                    f"deleted, but tier {tier.name} could not make it durable: {exc}"
                ) from exc
        return removed

    def pin(self, keys: Sequence[ChunkKey]) -> int:
        """Protect present chunks from eviction and demotion; returns how many were pinned."""
        keys = check_keys(keys)
        return len(self._index.pin(keys))

    def unpin(self, keys: Sequence[ChunkKey]) -> None:
        """Undo one :meth:`pin` per key; unknown or unpinned keys are ignored."""
        keys = check_keys(keys)
        self._index.unpin(keys)

    def touch(self, keys: Sequence[ChunkKey]) -> None:
        """Mark chunks as used, last key first, so a sequence's tail is evicted before its head."""
        keys = check_keys(keys)
        self._index.touch(keys)

    def keys(self) -> list[ChunkKey]:
        """Every chunk the index holds now (after a restart: what persistent tiers recovered).

        A snapshot, no I/O. To follow the index from here on, add a listener first (see
        :attr:`~kvtier.store.types.EventKind.INDEXED`).
        """
        return self._index.keys()

    def add_listener(self, listener: Listener) -> None:
        """Call ``listener`` with every :class:`StoreEvent` (from I/O threads; keep it fast)."""
        self._events.add(listener)

    def stats(self) -> StoreStats:
        """A snapshot of the store's counters and each tier's stats. Thread-safe."""
        return self._index.stats()

    def drain(self) -> None:
        """Wait until no operation is queued or running, background promotions included."""
        with self._idle:
            self._drainers += 1
            try:
                self._idle.wait_for(lambda: self._inflight == 0)
            finally:
                self._drainers -= 1

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
            self._mover.tier_failed(i, "flush", exc, 0)

    def close(self) -> None:
        """Finish queued work, persist memory-only chunks, flush and close every tier.

        Idempotent. Chunks that only memory tiers hold are moved into the persistent tier
        below them first (see :meth:`persist_memory_tiers`).
        """
        if self._closed:
            return
        self.drain()
        self.persist_memory_tiers()
        self._closed = True
        self._pool.shutdown(wait=True)
        for i, t in enumerate(self.tiers):
            try:
                self._flush_tier(i, t)
            finally:
                try:
                    t.close()
                except TierError as exc:
                    self._mover.tier_failed(i, "close", exc, 0)

    def persist_memory_tiers(self) -> int:
        """Move what memory tiers hold into the first persistent tier below them.

        Per memory tier, top first, the most recently used chunks go, until the
        persistent tier's capacity is spent; the rest stays (and is lost at exit, as a
        memory tier's content is). Returns how many chunks moved. Never raises for tier
        failures (a chunk that fails to move stays where it was).
        """
        persistent = [i for i, t in enumerate(self.tiers) if isinstance(t, PersistentTier)]
        if not persistent:
            return 0
        self.drain()
        room = {p: self.tiers[p].capacity_slots for p in persistent}
        total = 0
        for t, tier in enumerate(self.tiers):
            below = [p for p in persistent if p > t]
            if isinstance(tier, PersistentTier | SharedTier) or not below:
                continue
            target = below[0]
            started = time.monotonic()
            try:
                moved = self._mover.persist(t, target, room[target])
            except Exception:  # close must finish: what did not move is lost, as in a crash
                log.exception("tier %s: moving chunks into %s failed", tier.name, target)
                continue
            room[target] -= moved
            total += moved
            if moved:
                log.info(
                    "tier %s: %d chunk(s) moved into %s before closing (%.1f s)",
                    tier.name,
                    moved,
                    self.tiers[target].name,
                    time.monotonic() - started,
                )
        return total

    def __enter__(self) -> TieredStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _submit(self, fn: Callable[..., T], *args: object, inline: bool = False) -> Future[T]:
        """Run ``fn`` on an I/O thread (or, ``inline``, on this one), counted so
        :meth:`drain` can wait for it."""
        with self._idle_lock:
            self._inflight += 1
        try:
            return (INLINE if inline else self._pool).submit(fn, *args, on_done=self._done)
        except RuntimeError as exc:  # the pool was shut down by close()
            self._done(None)
            raise ClosedError("the store is closed") from exc

    def _background(self, fn: Callable[[], object]) -> None:
        """Schedule background work (promotions) unless the store is closing."""
        if not self._closed:
            self._submit(fn)

    def _done(self, _fut: object) -> None:
        with self._idle_lock:
            self._inflight -= 1
            if self._inflight == 0 and self._drainers:
                self._idle.notify_all()

    def _check_open(self) -> None:
        if self._closed:
            raise ClosedError("the store is closed")
