"""Per-tenant, per-tier byte quotas: which tenant a chunk belongs to, and its limits.

A chunk's tenant travels in its key: when quotas are on, whoever maps a tenant's keys
into the store (the daemon's :class:`~kvtier.service.tenants.KeyMapper`, the vLLM
connector for a ``cache_salt``) overwrites the first :data:`TAG_BYTES` bytes of each
key with the tenant's *tag* (:func:`tenant_tag`). The store, its index and every tier
then know a chunk's tenant with no field added anywhere, and it survives restarts: a
persistent tier recovers the keys, hence the tenants, with the chunks. The rest of the
key is still the keyed hash (96 bits), so keys stay unguessable and collision-free.

The same tags give per-tenant, per-tier figures (:class:`FigureBooks`): hits, misses,
bytes stored and read, evictions. Their labels are bounded by the configuration: a row
per tenant it names (:attr:`Quotas.labels`), and one row, :data:`OTHER`, for every other
tag (a tenant under the default quota whose name the store never learns, such as a
connector's free-form cache salt), so no client can grow the series.
"""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from typing_extensions import override

from kvtier.keys import TAG_BYTES, ChunkKey
from kvtier.store.policy import EvictionFactory, EvictionPolicy
from kvtier.tiers.base import Tier

OTHER = "(other)"
"""The figures' label of every tenant the configuration does not name (a tenant name
cannot hold parentheses, so no named tenant shares it)."""
ANONYMOUS = "anonymous"
"""The figures' label of the anonymous tenant ``""`` (a daemon without tokens, a
connector request without a cache salt)."""


def tenant_tag(name: str) -> bytes:
    """The tag of tenant ``name`` (``""``: the anonymous tenant) in its chunk keys."""
    return hashlib.blake2b(b"kvtier/tenant\0" + name.encode(), digest_size=TAG_BYTES).digest()


def tag_of(key: bytes) -> int:
    """The tenant tag a (tagged) key carries, as an int."""
    return int.from_bytes(key[:TAG_BYTES], "big")


class Quotas:
    """Byte limits per tenant and tier, looked up by a key's tag. Immutable.

    Args:
        named: tenant name -> {tier position -> byte limit}; a tier not listed is
            unlimited for that tenant.
        default: {tier position -> byte limit} of every tenant not in ``named``.
        also_named: tenants under ``default`` whose figures are still kept by name
            (the daemon's token names; ``""``, the anonymous tenant).
    """

    def __init__(
        self,
        named: Mapping[str, Mapping[int, int]],
        default: Mapping[int, int],
        *,
        also_named: Iterable[str] = (),
    ) -> None:
        self._named = {tag_of(tenant_tag(n)): dict(lim) for n, lim in named.items()}
        if len(self._named) != len(named):
            raise ValueError("two tenant names share a tag")  # 1 in 2^32 per pair
        self._names = {tag_of(tenant_tag(n)): n for n in named}
        for n in also_named:
            self._names.setdefault(tag_of(tenant_tag(n)), n)
        self._default = dict(default)
        # The figures' label of each tenant kept by name: its name, "" as ANONYMOUS
        # (unless a tenant is named so: then "" goes under OTHER, one label each).
        self.labels: dict[int, str] = {
            tag: (name or ANONYMOUS)
            for tag, name in sorted(self._names.items(), key=lambda kv: kv[1])
            if name or ANONYMOUS not in self._names.values()
        }

    def limit(self, tag: int, tier: int) -> int | None:
        """The byte limit of the tenant tagged ``tag`` in ``tier``; None: unlimited."""
        return self._named.get(tag, self._default).get(tier)

    def default_limit(self, tier: int) -> int | None:
        """The byte limit in ``tier`` of each tenant not named; None: unlimited."""
        return self._default.get(tier)

    def name(self, tag: int) -> str:
        """A named tenant's name, else the tag in hex (a tenant under the default)."""
        return self._names.get(tag, f"{tag:08x}")

    def label(self, tag: int) -> str:
        """The tenant's label in the figures: :attr:`labels`, else :data:`OTHER`."""
        return self.labels.get(tag, OTHER)


class TenantOrders(EvictionPolicy):
    """A tier's eviction order, and the same policy's order over each tenant's chunks.

    A tenant over its quota must find its own coldest chunks. Filtering the tier's order
    by tag would walk past every colder chunk of the other tenants, under the index's
    lock, on each such put: with 100,000 of them that is a tenth of a second a put, for
    every tenant. Here each tenant's chunks keep an order of their own (an instance of
    the tier's policy, fed the same calls for them), so :meth:`candidates_of` costs what
    the victims cost. With LRU the victims are the ones the tier's order, filtered,
    gives; with an adaptive policy (ARC) each tenant's order adapts to its own stream.
    Guarded by the index's lock, as every policy is.
    """

    def __init__(self, make: EvictionFactory) -> None:
        self._make = make
        self._all = make()
        self._own: dict[bytes, EvictionPolicy] = {}
        # Chunks per tag: a tenant's order goes when its last chunk leaves the tier, so
        # tags that come and go (a connector's cache salts) leave nothing behind.
        self._count: dict[bytes, int] = {}

    @override
    def insert(self, key: ChunkKey, nbytes: int) -> None:
        self._all.insert(key, nbytes)
        tag = key[:TAG_BYTES]
        own = self._own.get(tag)
        if own is None:
            own = self._own[tag] = self._make()
        own.insert(key, nbytes)
        self._count[tag] = self._count.get(tag, 0) + 1

    @override
    def touch(self, key: ChunkKey) -> None:
        self._all.touch(key)
        own = self._own.get(key[:TAG_BYTES])
        if own is not None:
            own.touch(key)

    @override
    def remove(self, key: ChunkKey) -> None:
        self._all.remove(key)
        tag = key[:TAG_BYTES]
        own = self._own.get(tag)
        if own is None:
            return
        own.remove(key)
        left = self._count[tag] - 1
        if left > 0:
            self._count[tag] = left
        else:
            del self._own[tag], self._count[tag]

    @override
    def candidates(self) -> Iterator[ChunkKey]:
        return self._all.candidates()

    def candidates_of(self, tag: int) -> Iterator[ChunkKey]:
        """The chunks of the tenant tagged ``tag`` in this tier, best victim first."""
        own = self._own.get(tag.to_bytes(TAG_BYTES, "big"))
        return iter(()) if own is None else own.candidates()


class QuotaBooks:
    """What each tenant holds and has reserved per tier, against its :class:`Quotas`.

    Guarded by the index's lock: the index calls it with the lock held, and
    :meth:`release` and :meth:`use` take it (reentrant). A chunk is charged the
    slot it takes (``slot_bytes[tier]``), whatever its value's length: a tier's room is
    counted in slots, so quotas summing to a tier's capacity fit in it. Reservations are
    taken by puts and moves before they write, and given back once what they wrote is
    indexed (or was not written), so used + reserved never passes a limit.
    """

    def __init__(self, quotas: Quotas, tiers: Sequence[Tier], lock: threading.RLock) -> None:
        self.quotas = quotas
        self._slot = [t.slot_bytes for t in tiers]
        self._lock = lock
        self._used: dict[tuple[int, int], int] = {}
        self._reserved: dict[tuple[int, int], int] = {}
        self.figures = FigureBooks(quotas, [t.name for t in tiers])

    def charge(
        self, keys: Sequence[bytes], t: int, sign: int, *, to: int | None = None, stored: int = 0
    ) -> None:
        """Count ``keys`` as indexed in tier ``t`` (``sign`` -1: as gone from it; then
        ``to``: as moved into that tier); ``stored``: as values of that many bytes each
        just written there (the figures' ``stored_*``)."""
        if stored:
            self.figures.stored(keys, t if to is None else to, stored)
        for key in keys:
            k = (tag_of(key), t)
            self._used[k] = self._used.get(k, 0) + sign * self._slot[t]
            if to is not None:
                k = (k[0], to)
                self._used[k] = self._used.get(k, 0) + self._slot[to]

    def try_reserve(self, tag: int, t: int, nbytes: int) -> int:
        """Reserve ``nbytes`` of the tenant's quota in tier ``t`` and return 0 if they
        fit (or it has no limit there); else reserve nothing and return the bytes by
        which they would pass it."""
        limit = self.quotas.limit(tag, t)
        if limit is None:
            return 0
        k = (tag, t)
        over = self._used.get(k, 0) + self._reserved.get(k, 0) + nbytes - limit
        if over > 0:
            return over
        self._reserved[k] = self._reserved.get(k, 0) + nbytes
        return 0

    def release(self, t: int, tag: int, nbytes: int) -> None:
        """Give back a reservation (of the index's ``prepare_quota``)."""
        if self.quotas.limit(tag, t) is None:
            return  # nothing was reserved
        k = (tag, t)
        with self._lock:
            left = self._reserved.get(k, 0) - nbytes
            if left:
                self._reserved[k] = left
            else:
                self._reserved.pop(k, None)

    def use(self) -> dict[tuple[int, int], int]:
        """Bytes held per (tenant tag, tier)."""
        with self._lock:
            return {k: v for k, v in self._used.items() if v}

    def figures_now(self) -> tuple[TenantFigures, ...]:
        """A snapshot of the :attr:`figures`, quota use folded in."""
        with self._lock:
            return self.figures.snapshot(self.use())


class Located(Protocol):
    """A chunk found in a tier (the index's slots)."""

    @property
    def key(self) -> bytes: ...
    @property
    def tier(self) -> int: ...


@dataclass(frozen=True, slots=True)
class TierFigures:
    """One tenant's figures in one tier. Chunk and byte figures count since the store
    started; the quota figures are gauges.

    Attributes:
        tier: the tier's name.
        lookup_hit_chunks: chunks that lookups found in this tier.
        read_chunks: chunks that gets served from this tier.
        read_bytes: value bytes that gets served from this tier.
        stored_chunks: chunks written into this tier: new values, and chunks moved
            into it (demoted or promoted).
        stored_bytes: value bytes of ``stored_chunks``.
        evicted_chunks: chunks that left this tier to make room (demoted or dropped),
            for the tier or for the tenant's quota in it.
        quota_used_bytes: what the tenant's chunks take in the tier now (a slot each);
            for :data:`OTHER`, the sum over every tenant under it.
        quota_limit_bytes: the tenant's limit in the tier (for :data:`OTHER`, the
            default quota, which binds each tenant under it alone); None: unlimited.
    """

    tier: str
    lookup_hit_chunks: int
    read_chunks: int
    read_bytes: int
    stored_chunks: int
    stored_bytes: int
    evicted_chunks: int
    quota_used_bytes: int
    quota_limit_bytes: int | None


@dataclass(frozen=True, slots=True)
class TenantFigures:
    """One tenant's figures (a label of :attr:`Quotas.labels`, or :data:`OTHER`).

    Attributes:
        tenant: the label.
        lookup_miss_chunks: chunks that lookups asked for and no tier held.
        tiers: the figures in each tier, top first.
    """

    tenant: str
    lookup_miss_chunks: int
    tiers: tuple[TierFigures, ...]


class FigureBooks:
    """Per-tenant, per-tier counters of one store: a row per label of
    :attr:`Quotas.labels`, and one for :data:`OTHER`.

    Guarded by the index's lock: the index calls the counting methods with it held.
    Counting costs a slice of each key and a dict lookup (no label is built until
    :meth:`snapshot`); counters are flat lists indexed ``row * tiers + tier``.
    """

    def __init__(self, quotas: Quotas, tier_names: Sequence[str]) -> None:
        self.quotas = quotas
        self._tiers = tuple(tier_names)
        self._labels = (*quotas.labels.values(), OTHER)
        self._row = {tag.to_bytes(TAG_BYTES, "big"): i for i, tag in enumerate(quotas.labels)}
        self._other = len(self._labels) - 1
        n = len(self._labels) * len(self._tiers)
        self._hits = [0] * n
        self._read = [0] * n
        self._read_bytes = [0] * n
        self._stored = [0] * n
        self._stored_bytes = [0] * n
        self._evicted = [0] * n
        self._misses = [0] * len(self._labels)

    def _at(self, key: bytes, t: int) -> int:
        return self._row.get(key[:TAG_BYTES], self._other) * len(self._tiers) + t

    def looked_up(self, found: Iterable[Located], missing: Sequence[bytes]) -> None:
        """Count a lookup: the chunks it found (where), and the keys it did not."""
        for sl in found:
            self._hits[self._at(sl.key, sl.tier)] += 1
        for key in missing:
            self._misses[self._row.get(key[:TAG_BYTES], self._other)] += 1

    def read(self, key: bytes, t: int, value_bytes: int) -> None:
        """Count one chunk a get served from tier ``t``."""
        i = self._at(key, t)
        self._read[i] += 1
        self._read_bytes[i] += value_bytes

    def stored(self, keys: Iterable[bytes], t: int, value_bytes: int) -> None:
        """Count chunks of ``value_bytes`` each written into tier ``t``."""
        for key in keys:
            i = self._at(key, t)
            self._stored[i] += 1
            self._stored_bytes[i] += value_bytes

    def evicted(self, keys: Iterable[bytes], t: int) -> None:
        """Count chunks claimed to leave tier ``t`` to make room."""
        for key in keys:
            self._evicted[self._at(key, t)] += 1

    def snapshot(self, use: Mapping[tuple[int, int], int]) -> tuple[TenantFigures, ...]:
        """The figures, a :class:`TenantFigures` per label (:data:`OTHER` last), with
        the quota use ``use`` ((tag, tier) -> bytes, :meth:`QuotaBooks.use`) folded in."""
        nt = len(self._tiers)
        used = [0] * len(self._stored)
        for (tag, t), nbytes in use.items():
            used[self._at(tag.to_bytes(TAG_BYTES, "big"), t)] += nbytes
        row_tags: list[int | None] = [*self.quotas.labels, None]
        q = self.quotas
        out: list[TenantFigures] = []
        for r, label in enumerate(self._labels):
            tiers = []
            row_tag = row_tags[r]
            for t, name in enumerate(self._tiers):
                i = r * nt + t
                limit = q.default_limit(t) if row_tag is None else q.limit(row_tag, t)
                tiers.append(
                    TierFigures(
                        name,
                        self._hits[i],
                        self._read[i],
                        self._read_bytes[i],
                        self._stored[i],
                        self._stored_bytes[i],
                        self._evicted[i],
                        used[i],
                        limit,
                    )
                )
            out.append(TenantFigures(label, self._misses[r], tuple(tiers)))
        return tuple(out)
