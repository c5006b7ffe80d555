"""Values the store returns. All frozen."""

from __future__ import annotations

import enum
from dataclasses import dataclass

from kvtier.keys import ChunkKey
from kvtier.tiers.base import TierStats

# The package re-exports exactly these (kvtier/store/__init__.py): one list of the public values.
__all__ = [
    "EventKind",
    "GetResult",
    "LookupResult",
    "PolicyCount",
    "PutResult",
    "StoreEvent",
    "StoreStats",
]


@dataclass(frozen=True, slots=True)
class LookupResult:
    """Leading run of present chunks.

    Attributes:
        hits: how many leading keys are present (a prefix; later keys are not checked
            once one is missing).
        tiers: the tier name of each hit, in key order.
        value_bytes: the value length of each hit, in key order (sizes a get's buffer).
    """

    hits: int
    tiers: tuple[str, ...]
    value_bytes: tuple[int, ...] = ()


@dataclass(frozen=True, slots=True)
class PutResult:
    """Outcome of one put.

    Attributes:
        stored: chunks written by this call.
        present: chunks skipped because they were already stored (or being stored).
        rejected: chunks placement declined or no tier had room for.
        failed: chunks whose write failed in a tier (logged and counted).
    """

    stored: int
    present: int
    rejected: int
    failed: int


@dataclass(frozen=True, slots=True)
class GetResult:
    """Outcome of one get.

    Attributes:
        chunks: leading chunks copied into the caller's buffer (a prefix of the keys).
        nbytes: bytes copied, packed from the start of the buffer.
        value_bytes: length of each copied chunk, in order.
        tiers: tier name each chunk came from.
    """

    chunks: int
    nbytes: int
    value_bytes: tuple[int, ...]
    tiers: tuple[str, ...]


class EventKind(enum.Enum):
    STORED = "stored"
    DEMOTED = "demoted"
    PROMOTED = "promoted"
    DROPPED = "dropped"
    DELETED = "deleted"
    CORRUPT = "corrupt"
    TIER_ERROR = "tier_error"
    # The index changed: keys entered it (stored, adopted from a shared tier) or left
    # every tier (dropped, deleted, corrupt or unreadable). Always with ``keys``, so a
    # listener can follow exactly what the store holds (the vLLM connector's mirror).
    INDEXED = "indexed"
    UNINDEXED = "unindexed"


@dataclass(frozen=True, slots=True)
class StoreEvent:
    """Something the store did to chunks, for listeners (metrics, policies, journals).

    Attributes:
        keys: the chunks concerned, for :attr:`EventKind.INDEXED` and
            :attr:`EventKind.UNINDEXED` (empty for the other kinds, which count).
    """

    kind: EventKind
    tier: str
    chunks: int
    nbytes: int
    detail: str = ""
    keys: tuple[ChunkKey, ...] = ()

    @property
    def index_change(self) -> int:
        """+1 when ``keys`` entered the index, -1 when they left it, 0 otherwise."""
        if self.kind is EventKind.INDEXED:
            return 1
        return -1 if self.kind is EventKind.UNINDEXED else 0


@dataclass(frozen=True, slots=True)
class PolicyCount:
    """One figure the placement policy reports about its decisions (``/v1/stats``,
    ``/metrics``): why a tier stays empty, how much of an SSD's write budget is left.

    Attributes:
        name: snake_case and stable, it names a metric: ``demoted_chunks``,
            ``budget_available_bytes``.
        value: the count or amount.
        tier: the store tier it concerns; "" for the store as a whole.
        gauge: a level that rises and falls; otherwise a counter that only grows.
        help: one line saying what it counts.
    """

    name: str
    value: float
    tier: str = ""
    gauge: bool = False
    help: str = ""


@dataclass(slots=True)
class Counters:
    """The store's monotonic counters, kept by the index (mutable, under its lock);
    :meth:`~kvtier.store.index.StoreIndex.stats` freezes them into :class:`StoreStats`,
    whose fields of the same names they fill (a field missing on either side fails the
    first ``stats()`` call, which every store test makes)."""

    lookups: int = 0
    lookup_hit_chunks: int = 0
    lookup_miss_chunks: int = 0
    gets: int = 0
    get_chunks: int = 0
    get_bytes: int = 0
    puts: int = 0
    put_chunks: int = 0
    put_present: int = 0
    put_rejected: int = 0
    demoted_chunks: int = 0
    promoted_chunks: int = 0
    dropped_chunks: int = 0
    deleted_chunks: int = 0
    corrupt_chunks: int = 0
    tier_errors: int = 0
    adopted_chunks: int = 0


@dataclass(frozen=True, slots=True)
class StoreStats:
    """Store-wide counters, and each tier's own."""

    chunks: int
    lookups: int
    lookup_hit_chunks: int
    lookup_miss_chunks: int
    gets: int
    get_chunks: int
    get_bytes: int
    puts: int
    put_chunks: int
    put_present: int
    put_rejected: int
    demoted_chunks: int
    promoted_chunks: int
    dropped_chunks: int
    deleted_chunks: int
    corrupt_chunks: int
    tier_errors: int
    tier_hits: tuple[tuple[str, int], ...]
    tiers: tuple[TierStats, ...]
    # Chunks found in a shared tier (stored by another process) and added to the index.
    adopted_chunks: int = 0
    # What the placement policy decided (:meth:`PlacementPolicy.report`); empty for one
    # that reports nothing, such as ``keep``.
    placement: tuple[PolicyCount, ...] = ()
