"""What the scheduler side knows of the workers' stores, without holding their bytes.

vLLM asks the scheduler side (EngineCore process) how many leading chunks of a request
kvtier can load, before any worker runs; the stores live in the workers. So the workers
tell the scheduler side which keys their stores hold, and the scheduler keeps a compact
picture of it:

* :class:`IndexFeed` (worker side) starts with a snapshot of the store's index, i.e.
  what the persistent tiers recovered after journal replay and checksum verification,
  taken without reading chunk data, and then follows the store's events, which carry
  keys: every key the index gains (stored, adopted) or loses (dropped or deleted from
  every tier, corrupt, unreadable). It ships both in :class:`IndexUpdate`.
* :class:`StoreMirror` (scheduler side) keeps one :class:`KeyFilter` per worker rank,
  a counting Bloom filter over that rank's rank keys, fed by exactly that stream. A
  logical key is loadable when every rank's filter holds its rank key.

Memory: :data:`COUNTERS_PER_KEY` one-byte counters per chunk of the store's capacity
and rank (10 B per key; at least :data:`MIN_COUNTERS`), whatever the keys are: 100 MB
per rank for a store of ten million chunks. The worker side holds no per-key state
beyond the store's own index (the start-up snapshot lists the index's own key objects,
8 B per key, for the time it takes to hash them).

Errors it can make, and what they cost:

* False positives: a key the store does not hold tests present with probability about
  ``(1 - exp(-k n / m)) ** k`` (0.8% at full capacity with the defaults, far less
  below it). The scheduler then promises a load the worker cannot serve: the worker's
  ``store.get`` returns fewer chunks, the worker reports the missing blocks through
  ``get_block_ids_with_load_errors`` and vLLM recomputes them (the chunk's key is a hash
  of its tokens, so no other chunk's bytes can be served for it: a false positive is a
  recompute, never wrong KV). The failed key joins a bounded set of known misses until
  it is stored again, so it is not promised twice.
* False negatives: none while counters stay below 255 (a saturated counter is never
  decremented, which can only add false positives).

Threading: :class:`IndexFeed` is called from the store's I/O threads (events) and the
worker's engine thread (``take``), under its own lock. :class:`StoreMirror` lives on the
scheduler thread.
"""

from __future__ import annotations

import math
import threading
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

from kvtier.tiers.base import PersistentTier, SharedTier

from .keys import rank_keys

if TYPE_CHECKING:
    from kvtier.store.store import TieredStore
    from kvtier.store.types import StoreEvent

COUNTERS_PER_KEY = 10
"""One-byte counters per key of capacity: 0.8% false positives at full capacity (k=7)."""
HASHES = 7
MIN_COUNTERS = 1 << 16
"""Small stores get at least 64 KiB of counters, so their false-positive rate is ~0."""
KNOWN_MISSES = 65536
"""Logical keys recently found missing on a load, kept exactly (LRU) to beat the filter."""

_MASK64 = (1 << 64) - 1
_BATCH = 1 << 18  # keys hashed per numpy pass (bounds the temporary arrays to ~16 MB)


def memory_tier_names(store: TieredStore) -> frozenset[str]:
    """The store's tiers of this process's memory: neither persistent (nvme) nor shared
    (Redis). A load from them takes far less than an engine step."""
    return frozenset(t.name for t in store.tiers if not isinstance(t, PersistentTier | SharedTier))


class KeyFilter:
    """A counting Bloom filter over 16-byte keys that are already uniform hashes.

    Positions come from the key's two 64-bit halves by double hashing, so no further
    hashing is needed (rank keys are xxh3-128 digests).

    Args:
        counters: number of one-byte counters (the filter's size in bytes).
        hashes: positions per key.
        data: counters to start from (a snapshot's), ``counters`` bytes.
    """

    def __init__(self, counters: int, hashes: int = HASHES, data: bytes | None = None) -> None:
        if counters < 1 or hashes < 1:
            raise ValueError(
                f"a filter needs counters >= 1 and hashes >= 1, got {counters}, {hashes}"
            )
        self.hashes = hashes
        self.counters = (
            np.zeros(counters, dtype=np.uint8)
            if data is None
            else np.frombuffer(bytearray(data), dtype=np.uint8)
        )
        if self.counters.size != counters:
            raise ValueError(f"{self.counters.size} counters given, {counters} expected")
        self.keys = 0  # adds minus removes: the keys the filter now stands for

    @classmethod
    def for_capacity(cls, keys: int) -> KeyFilter:
        """A filter sized for ``keys`` keys at :data:`COUNTERS_PER_KEY` bytes each."""
        return cls(max(MIN_COUNTERS, COUNTERS_PER_KEY * keys))

    @property
    def nbytes(self) -> int:
        return int(self.counters.nbytes)

    def false_positive_rate(self, keys: int | None = None) -> float:
        """Expected false-positive rate with ``keys`` keys (default: those it holds now)."""
        n = self.keys if keys is None else keys
        m, k = self.counters.size, self.hashes
        return float((1.0 - math.exp(-k * n / m)) ** k)

    def _positions(self, keys: Sequence[bytes]) -> npt.NDArray[Any]:
        raw = np.frombuffer(b"".join(keys), dtype="<u8").reshape(-1, 2)
        h1, h2 = raw[:, 0:1], raw[:, 1:2] | np.uint64(1)
        steps = np.arange(self.hashes, dtype=np.uint64)[None, :]
        with np.errstate(over="ignore"):
            return ((h1 + steps * h2) % np.uint64(self.counters.size)).ravel()  # type: ignore[no-any-return]

    def _apply(self, keys: Sequence[bytes], sign: int) -> None:
        for lo in range(0, len(keys), _BATCH):
            batch = keys[lo : lo + _BATCH]
            if any(len(k) != 16 for k in batch):
                raise ValueError("filter keys are 16-byte digests")
            pos, counts = np.unique(self._positions(batch), return_counts=True)
            cur = self.counters[pos].astype(np.int32)
            sticky = cur == 255  # saturated: never decremented (no false negatives)
            new = np.clip(cur + sign * counts, 0, 255)
            new[sticky] = 255
            self.counters[pos] = new.astype(np.uint8)
            self.keys += sign * len(batch)

    def add(self, keys: Sequence[bytes]) -> None:
        """Count keys in; each key must be added once per time it enters the store."""
        if keys:
            self._apply(keys, 1)

    def remove(self, keys: Sequence[bytes]) -> None:
        """Count keys out; only keys that were added (the store's own removals)."""
        if keys:
            self._apply(keys, -1)

    def __contains__(self, key: object) -> bool:
        if not isinstance(key, bytes) or len(key) != 16:
            return False
        h1 = int.from_bytes(key[:8], "little")
        h2 = int.from_bytes(key[8:], "little") | 1
        m = self.counters.size
        c = self.counters
        return all(c[((h1 + i * h2) & _MASK64) % m] for i in range(self.hashes))

    def to_bytes(self) -> bytes:
        return self.counters.tobytes()


@dataclass(frozen=True, slots=True)
class IndexUpdate:
    """One worker rank's index changes since its last update (worker to scheduler).

    Attributes:
        snapshot: the first update only: the filter of the store's index at start (what
            the persistent tiers recovered), as ``KeyFilter`` counters; None afterwards.
        hashes: positions per key of that filter.
        added: rank keys the index gained since the previous update, in order.
        removed: rank keys the index lost (left every tier) since the previous update.
        recovered: keys in the snapshot, for logs.
        memory_slots: with the snapshot: chunks the store's memory tiers hold (tiers
            neither persistent nor shared), sizing the scheduler's guess of what loads
            fast (scheduler.py, ``async_loads``).
        slow_tiers: with the snapshot: the store has a persistent or shared tier.
        slots: with the snapshot: chunks all the store's tiers hold (the connector's
            store has a slot per entry); while its index holds fewer keys, with room for
            every save in flight, no put evicts (scheduler.py, the save fence).
    """

    snapshot: bytes | None
    hashes: int
    added: tuple[bytes, ...] = ()
    removed: tuple[bytes, ...] = ()
    recovered: int = 0
    memory_slots: int = 0
    slow_tiers: bool = False
    slots: int = 0

    def is_empty(self) -> bool:
        return self.snapshot is None and not self.added and not self.removed


class IndexFeed:
    """Worker side: follows one store's index and hands the changes out in updates.

    The snapshot is taken when the feed is built, before the store serves anything (so
    no event can fall between the snapshot and the listener).

    Args:
        store: the rank's store, just built (its persistent tiers recovered).
    """

    def __init__(self, store: TieredStore) -> None:
        self._lock = threading.Lock()
        self._added: list[bytes] = []
        self._removed: list[bytes] = []
        slots = sum(t.capacity_slots for t in store.tiers)
        self._slots = slots
        keys = store.keys()
        filt = KeyFilter.for_capacity(max(slots, len(keys)))
        filt.add(keys)
        self._snapshot: bytes | None = filt.to_bytes()
        self._hashes = filt.hashes
        self._recovered = len(keys)
        memory = memory_tier_names(store)
        self._memory_slots = sum(t.capacity_slots for t in store.tiers if t.name in memory)
        self._slow_tiers = len(memory) < len(store.tiers)
        store.add_listener(self._on_event)

    def _on_event(self, event: StoreEvent) -> None:
        change = event.index_change
        if not change or not event.keys:
            return
        with self._lock:
            (self._added if change > 0 else self._removed).extend(event.keys)

    def take(self) -> IndexUpdate | None:
        """The changes since the last call (the snapshot the first time); None if none."""
        with self._lock:
            up = IndexUpdate(
                self._snapshot,
                self._hashes,
                tuple(self._added),
                tuple(self._removed),
                self._recovered,
                self._memory_slots,
                self._slow_tiers,
                self._slots,
            )
            self._snapshot = None
            self._added, self._removed = [], []
        return None if up.is_empty() else up


@dataclass
class _Rank:
    salt: bytes
    filter: KeyFilter
    memory_slots: int = 0
    slow_tiers: bool = False
    slots: int = 0


@dataclass
class StoreMirror:
    """Scheduler side: which logical keys every worker rank's store holds.

    Args:
        world_size: ranks (TP x PP) that each hold their own store; a logical key is
            loadable once every one of them holds its rank key.
    """

    world_size: int
    _ranks: dict[bytes, _Rank] = field(default_factory=dict)
    _misses: OrderedDict[bytes, None] = field(default_factory=OrderedDict)

    def ready(self) -> bool:
        """Whether every rank has sent its start-up snapshot."""
        return len(self._ranks) >= self.world_size

    def __contains__(self, key: object) -> bool:
        if not isinstance(key, bytes) or not self.ready() or key in self._misses:
            return False
        return all(rank_keys(r.salt, [key])[0] in r.filter for r in self._ranks.values())

    def __len__(self) -> int:
        """Keys the smallest rank's filter stands for (an estimate of loadable chunks)."""
        return min((r.filter.keys for r in self._ranks.values()), default=0)

    def apply(self, updates: dict[bytes, IndexUpdate]) -> None:
        """Apply ranks' updates (salt -> update), in the order the workers sent them."""
        for salt, up in updates.items():
            rank = self._ranks.get(salt)
            if up.snapshot is not None:
                rank = self._ranks[salt] = _Rank(
                    salt,
                    KeyFilter(len(up.snapshot), up.hashes, up.snapshot),
                    up.memory_slots,
                    up.slow_tiers,
                    up.slots,
                )
                rank.filter.keys = up.recovered
            if rank is None:  # an update before its snapshot: cannot happen in order
                continue
            # Adds first: a key added and removed in one update then nets out without a
            # counter ever dipping below zero.
            rank.filter.add(up.added)
            rank.filter.remove(up.removed)

    def memory_chunks(self) -> int:
        """Chunks the smallest rank's memory tiers hold (0 before the snapshots)."""
        return min((r.memory_slots for r in self._ranks.values()), default=0)

    def room(self) -> int:
        """Chunks the fullest rank's store can still take before a put evicts (0 before
        the snapshots, or when unknown)."""
        if not self.ready():
            return 0
        return max(0, min(r.slots - r.filter.keys for r in self._ranks.values()))

    def slow_tiers(self) -> bool:
        """Whether a rank's store has a tier below memory (persistent or shared)."""
        return any(r.slow_tiers for r in self._ranks.values())

    def confirm(self, key: bytes) -> None:
        """Every rank stored ``key`` (a save settled): it is no longer a known miss."""
        self._misses.pop(key, None)

    def forget(self, key: bytes) -> None:
        """A load of ``key`` failed on some rank: never promise it until stored again."""
        self._misses[key] = None
        self._misses.move_to_end(key)
        while len(self._misses) > KNOWN_MISSES:
            self._misses.popitem(last=False)

    def touch(self, keys: Iterable[bytes]) -> None:
        """No-op: the stores keep their own recency."""

    def nbytes(self) -> int:
        """Memory the filters take (the known-miss set adds at most ~10 MB)."""
        return sum(r.filter.nbytes for r in self._ranks.values())
