"""Per-tenant, per-tier byte quotas: which tenant a chunk belongs to, and its limits.

A chunk's tenant travels in its key: when quotas are on, whoever maps a tenant's keys
into the store (the daemon's :class:`~kvtier.service.tenants.KeyMapper`, the vLLM
connector for a ``cache_salt``) overwrites the first :data:`TAG_BYTES` bytes of each
key with the tenant's *tag* (:func:`tenant_tag`). The store, its index and every tier
then know a chunk's tenant with no field added anywhere, and it survives restarts: a
persistent tier recovers the keys, hence the tenants, with the chunks. The rest of the
key is still the keyed hash (96 bits), so keys stay unguessable and collision-free.
"""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Mapping, Sequence

from kvtier.keys import ChunkKey
from kvtier.tiers.base import Tier

TAG_BYTES = 4


def tenant_tag(name: str) -> bytes:
    """The tag of tenant ``name`` (``""``: the anonymous tenant) in its chunk keys."""
    return hashlib.blake2b(b"kvtier/tenant\0" + name.encode(), digest_size=TAG_BYTES).digest()


def tag_key(key: bytes, tag: bytes) -> ChunkKey:
    """``key`` with its first bytes replaced by a tenant's ``tag``."""
    return ChunkKey(tag + key[TAG_BYTES:])


def tag_of(key: bytes) -> int:
    """The tenant tag a (tagged) key carries, as an int."""
    return int.from_bytes(key[:TAG_BYTES], "big")


class Quotas:
    """Byte limits per tenant and tier, looked up by a key's tag. Immutable.

    Args:
        named: tenant name -> {tier position -> byte limit}; a tier not listed is
            unlimited for that tenant.
        default: {tier position -> byte limit} of every tenant not in ``named``.
    """

    def __init__(self, named: Mapping[str, Mapping[int, int]], default: Mapping[int, int]) -> None:
        self._named = {tag_of(tenant_tag(n)): dict(lim) for n, lim in named.items()}
        if len(self._named) != len(named):
            raise ValueError("two tenant names share a tag")  # 1 in 2^32 per pair
        self._names = {tag_of(tenant_tag(n)): n for n in named}
        self._default = dict(default)

    def limit(self, tag: int, tier: int) -> int | None:
        """The byte limit of the tenant tagged ``tag`` in ``tier``; None: unlimited."""
        return self._named.get(tag, self._default).get(tier)

    def name(self, tag: int) -> str:
        """A named tenant's name, else the tag in hex (a tenant under the default)."""
        return self._names.get(tag, f"{tag:08x}")


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

    def charge(self, keys: Sequence[bytes], t: int, sign: int, *, to: int | None = None) -> None:
        """Count ``keys`` as indexed in tier ``t`` (``sign`` -1: as gone from it; then
        ``to``: as moved into that tier)."""
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
