"""Values the store returns. All frozen."""

from __future__ import annotations

import enum
from dataclasses import dataclass

from kvtier.tiers.base import TierStats


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


@dataclass(frozen=True, slots=True)
class StoreEvent:
    """Something the store did to chunks, for listeners (metrics, policies, journals)."""

    kind: EventKind
    tier: str
    chunks: int
    nbytes: int
    detail: str = ""


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
