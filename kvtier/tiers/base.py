"""The tier contract: a storage level that allocates extents and moves slot bytes.

A tier owns a :class:`~kvtier.alloc.BuddyAllocator` over its capacity, in units of one
*slot* (a chunk's bytes rounded up to 4 KiB, so every slot suits O_DIRECT and DMA). The
store decides what goes where; a tier only keeps bytes at offsets.

Subclasses implement two methods, :meth:`Tier._write` and :meth:`Tier._read`. Optional
hooks (:meth:`Tier.flush`, :meth:`Tier.close`, :meth:`Tier.faults`) are no-ops here.

What a tier offers beyond that is a *capability*: a small ABC it also derives from,
with the methods that capability needs, which the store and the registry ask for by
type (``isinstance``), never by a flag or a tier's name:

* :class:`ViewableTier`: its slots are plain memory, handed out as views to fill or
  read in place (host and CXL memory);
* :class:`PersistentTier`: its chunks survive a restart (nvme); the store recovers
  them at start, tells it what it frees, and makes deletions durable through it;
* :class:`SharedTier`: other processes and hosts write its medium too (Redis). Its
  allocator then bounds what this process indexes, and the store asks it about chunks
  missing from its own index, adopting the ones found.

A tier that offers none of them (gpu, meta) is the base contract alone.
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kvtier.alloc import Extent, make_allocator
from kvtier.errors import InputError
from kvtier.keys import ChunkKey, Namespace
from kvtier.units import align_up

SLOT_ALIGN = 4096
"""Slots and extents are aligned to 4 KiB: the O_DIRECT and DMA granule."""


@dataclass(frozen=True, slots=True)
class SlotRun:
    """A run of consecutive slots holding consecutive chunks of equal length.

    Attributes:
        offset: first slot, in slots from the start of the tier.
        keys: the chunks, one per slot, in order.
        value_bytes: bytes of each chunk's value (<= the tier's slot size). The caller's
            buffer holds the values packed: ``len(keys) * value_bytes`` bytes.
    """

    offset: int
    keys: tuple[ChunkKey, ...]
    value_bytes: int

    @property
    def n(self) -> int:
        return len(self.keys)

    @property
    def nbytes(self) -> int:
        return len(self.keys) * self.value_bytes


@dataclass(frozen=True, slots=True)
class TierGeometry:
    """Where a tier's slots come from; built once per tier by the registry.

    Attributes:
        name: the tier's name in stats and logs.
        capacity_bytes: bytes the tier may hold (rounded down to whole slots).
        slot_bytes: bytes of one chunk value; rounded up to :data:`SLOT_ALIGN`.
        max_extent_bytes: the cap on one extent.
    """

    name: str
    capacity_bytes: int
    slot_bytes: int
    max_extent_bytes: int


@dataclass(frozen=True, slots=True)
class TierSection:
    """One tier of the hierarchy, top (fastest) first in ``KVTierConfig.tiers``."""

    # Tier kind: host, cxl, gpu (nvme and redis once installed); see docs/configuration.md.
    kind: str
    # Name in stats, logs and metrics; defaults to the kind.
    name: str
    # Bytes this tier may hold.
    capacity_bytes: int
    # The kind's own options, validated against its options class.
    options: Any = None


@dataclass(frozen=True, slots=True)
class TierProfile:
    """What one tier costs and how fast it is; read by placement policies.

    Attributes:
        latency_s: time to first byte of a read.
        bandwidth_Bps: sustained bytes per second of large transfers.
        cost_per_gb_month: storage price in $/GB-month.
        endurance_dwpd: drive writes per day the medium is rated for; 0 = unlimited.
    """

    latency_s: float = 0.0
    bandwidth_Bps: float = 10e9
    cost_per_gb_month: float = 0.0
    endurance_dwpd: float = 0.0


@dataclass(frozen=True, slots=True)
class TierStats:
    """Counters of one tier (monotonic counters plus current occupancy)."""

    name: str
    kind: str
    capacity_bytes: int
    used_bytes: int
    slot_bytes: int
    allocated_extents: int
    external_fragmentation: float
    bytes_written: int
    bytes_read: int
    write_ops: int
    read_ops: int
    emulated: bool
    # Bytes that reached the medium (after codecs, with padding and journals): what
    # wears an SSD. Equal to bytes_written for tiers that add nothing.
    media_bytes_written: int = 0
    # False while the tier cannot serve (a Redis node down or hung): its chunks are misses.
    up: bool = True
    # Why the tier is down, empty while it is up.
    down_reason: str = ""
    # Transfers that failed in the tier (EIO, ENOSPC, timeouts), since start.
    io_errors: int = 0
    # Chunks whose bytes or metadata failed verification in the tier, since start.
    corrupt_chunks: int = 0


@dataclass(frozen=True, slots=True)
class TierFaults:
    """A tier's own view of its faults (see :meth:`Tier.faults`)."""

    up: bool = True
    down_reason: str = ""
    io_errors: int = 0
    corrupt_chunks: int = 0


class Tier(ABC):
    """One storage level.

    Thread-safety: allocation calls take the tier's lock; ``write``/``read`` of
    disjoint slot runs may run concurrently from the store's I/O threads. The store
    never reads or writes a run it has not allocated.

    Args:
        geometry: name, capacity, slot size and extent cap (see :class:`TierGeometry`).
        profile: latency, bandwidth and price the placement reads.
    """

    kind: str = "abstract"

    def __init__(
        self,
        geometry: TierGeometry,
        profile: TierProfile | None = None,
    ) -> None:
        g = geometry
        if g.slot_bytes < 1:
            raise InputError(f"tier {g.name}: slot_bytes must be >= 1, got {g.slot_bytes}")
        self.name = g.name
        self.slot_bytes = align_up(g.slot_bytes, SLOT_ALIGN)
        units = g.capacity_bytes // self.slot_bytes
        if units < 1:
            raise InputError(
                f"tier {g.name}: capacity {g.capacity_bytes} B holds no slot of {self.slot_bytes} B"
            )
        max_order = max(0, (g.max_extent_bytes // self.slot_bytes).bit_length() - 1)
        self.capacity_bytes = units * self.slot_bytes
        self.profile = profile or TierProfile()
        self._alloc = make_allocator(units, max_order)
        self._alloc_lock = threading.Lock()
        self._stat_lock = threading.Lock()
        self._bytes_written = 0
        self._bytes_read = 0
        self._write_ops = 0
        self._read_ops = 0

    # -- allocation (shared by every tier) --------------------------------------------------

    @property
    def capacity_slots(self) -> int:
        return self._alloc.capacity_units

    @property
    def free_slots(self) -> int:
        return self._alloc.free_units

    @property
    def max_extent_slots(self) -> int:
        return 1 << self._alloc.max_order

    def allocate(self, n_slots: int) -> list[Extent] | None:
        """Extents for ``n_slots`` slots (binary decomposition), or None if they do not fit."""
        with self._alloc_lock:
            return self._alloc.allocate_run(n_slots)

    def release(self, offset: int, n_slots: int) -> None:
        """Free ``n_slots`` slots from ``offset``: a whole extent, its tail or one slot."""
        with self._alloc_lock:
            self._alloc.free(offset, n_slots)

    # -- data movement ---------------------------------------------------------------------

    def write(self, run: SlotRun, src: memoryview) -> None:
        """Copy ``run.nbytes`` packed bytes from ``src`` into the run's slots. Blocking.

        Raises:
            TierIOError: the medium failed; nothing in the run may be trusted.
        """
        self._check(run, src)
        self._write(run, src)
        self.note_written(run.nbytes)

    def read(self, run: SlotRun, dst: memoryview) -> None:
        """Copy the run's values, packed, into ``dst``. Blocking.

        Raises:
            TierIOError: the medium failed.
            CorruptChunkError: a value failed verification; ``dst`` holds garbage.
        """
        self._check(run, dst)
        self._read(run, dst)
        self.count_read(run.nbytes)

    def count_read(self, nbytes: int) -> None:
        """Count one read of ``nbytes`` (also one made in place, through
        :meth:`ViewableTier.slot_view` or :meth:`ViewableTier.run_view`)."""
        with self._stat_lock:
            self._bytes_read += nbytes
            self._read_ops += 1

    @property
    def emulated(self) -> bool:
        """Whether the tier stands in for hardware this machine lacks (reported in its
        stats and logs; nothing above the tier behaves differently). Default: False."""
        return False

    def note_written(self, nbytes: int) -> None:
        """Count ``nbytes`` a caller wrote in place (:meth:`ViewableTier.slot_view`,
        :meth:`ViewableTier.run_view`) as one write."""
        with self._stat_lock:
            self._bytes_written += nbytes
            self._write_ops += 1

    def _check(self, run: SlotRun, buf: memoryview) -> None:
        if run.value_bytes > self.slot_bytes:
            raise InputError(f"value of {run.value_bytes} B exceeds slot of {self.slot_bytes} B")
        if buf.nbytes != run.nbytes:
            raise InputError(f"buffer of {buf.nbytes} B for a run of {run.nbytes} B")

    @abstractmethod
    def _write(self, run: SlotRun, src: memoryview) -> None:
        """Store the packed values of ``run`` from ``src`` (a flat, byte-format view)."""

    @abstractmethod
    def _read(self, run: SlotRun, dst: memoryview) -> None:
        """Load the packed values of ``run`` into ``dst`` (a flat, writable byte view)."""

    # -- optional hooks --------------------------------------------------------------------

    def flush(self) -> None:  # noqa: B027 - optional hook
        """Make everything written so far durable. Default: nothing to do."""

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release the tier's resources. Idempotent."""

    def media_bytes_written(self) -> int:
        """Bytes written to the medium itself; tiers with codecs or journals override."""
        return self._bytes_written

    def faults(self) -> TierFaults:
        """Whether the tier serves now, and its fault counters. Never blocks on I/O.

        Default: up, no faults counted.
        """
        return TierFaults()

    def stats(self) -> TierStats:
        media = self.media_bytes_written()
        f = self.faults()
        with self._alloc_lock:
            a = self._alloc.stats()
        with self._stat_lock:
            return TierStats(
                name=self.name,
                kind=self.kind,
                capacity_bytes=self.capacity_bytes,
                used_bytes=a.used_units * self.slot_bytes,
                slot_bytes=self.slot_bytes,
                allocated_extents=a.allocated_blocks,
                external_fragmentation=a.external_fragmentation,
                bytes_written=self._bytes_written,
                bytes_read=self._bytes_read,
                write_ops=self._write_ops,
                read_ops=self._read_ops,
                emulated=self.emulated,
                media_bytes_written=media,
                up=f.up,
                down_reason=f.down_reason,
                io_errors=f.io_errors,
                corrupt_chunks=f.corrupt_chunks,
            )


# -- capabilities ------------------------------------------------------------------------------


class ViewableTier(Tier):
    """A tier whose slots are plain memory at memcpy speed, handed out as views in place.

    The store fills a reserved slot through :meth:`slot_view` (the daemon receives a
    request body straight into it), serves a hit from it with no copy, and moves chunks
    from and into such slots with no staging copy (:meth:`run_view`). A caller that
    writes or reads through a view counts it with :meth:`~Tier.note_written` or
    :meth:`~Tier.count_read`, and holds the slots while it uses the view.

    A view may still be refused (None): outside the tier, or where the instance must
    route every transfer through :meth:`~Tier.write` and :meth:`~Tier.read` (an
    emulated CXL tier injects its latency there). The store then writes through.
    """

    @abstractmethod
    def slot_view(self, offset: int, nbytes: int) -> memoryview | None:
        """A writable view of the first ``nbytes`` of slot ``offset``, or None."""

    @abstractmethod
    def run_view(self, run: SlotRun) -> memoryview | None:
        """The run's values, packed, as one writable view of the medium in place, or None.

        Offered where :meth:`slot_view` is and the slots' bytes are the packed values
        (the values fill their slots, or the run is one chunk); None otherwise (slot
        padding lies between short values).
        """


class PersistentTier(Tier):
    """A tier whose chunks survive a restart.

    The store indexes what :meth:`recover` returns at start, calls :meth:`forget` before
    it frees slots, makes a deletion durable with :meth:`commit_forgets`, and on a clean
    close moves what only memory tiers hold into the first persistent tier below them.
    """

    @abstractmethod
    def recover(self) -> Sequence[SlotRun]:
        """Chunks that survived a restart, already allocated in this tier's allocator.

        Called once, by the store, before any other call.
        """

    @abstractmethod
    def forget(self, run: SlotRun) -> None:
        """The store is about to release the run's slots: they must not come back after
        a restart (the tier journals it)."""

    @abstractmethod
    def commit_forgets(self) -> None:
        """Make the :meth:`forget` calls of a deletion durable, as the tier's durability
        mode promises for writes (the store's ``delete`` calls it before answering).

        Raises:
            TierIOError: they could not be made durable (a full disk).
        """


class SharedTier(Tier):
    """A tier whose medium other processes and hosts also write (Redis).

    Its allocator bounds what this process indexes, not the medium. The store asks
    :meth:`probe` about chunks its own index lacks and adopts those found (claims a slot
    each, reads them through :meth:`~Tier.read`); it evicts or moves chunks out of the
    tier without touching the medium (others may use them), and deletes from the medium
    only through :meth:`discard`.
    """

    @abstractmethod
    def bind(self, namespace: Namespace) -> None:
        """The key namespace (model, KV spec, tenant) of the chunks this tier will hold.

        Called by :func:`kvtier.factory.build_store` before any I/O, so tenants and
        geometries stay apart in the shared medium.
        """

    @abstractmethod
    def probe(self, keys: Sequence[ChunkKey]) -> Sequence[int]:
        """Value lengths (bytes) of the leading ``keys`` present in the medium.

        In key order, stopping at the first absent key. Called with no store lock held;
        may block for the tier's own budget, and never raises (a failure reads as
        absence).
        """

    @abstractmethod
    def discard(self, keys: Sequence[ChunkKey]) -> int:
        """Delete ``keys``' values from the medium (the store's ``delete``); returns how
        many were present. Never raises."""
