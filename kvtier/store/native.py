"""The store index with its hot verbs in C, where the C core is built.

:class:`NativeStoreIndex` is a :class:`~kvtier.store.index.StoreIndex` whose verbs of
every put, get and delete (``present_run``, ``prepare_load``, ``complete_load``,
``prepare_store``, ``add_stored``, ``complete_store``, ``remove``) are
``kvtier._core.IndexVerbs``'s (``kvtier/_core_index.c``). They work on the same state
as the Python verbs, so every other verb (moves, evictions, quotas, adoption, recovery)
is the reference's, and a verb the C does not cover in some configuration (quotas, an
eviction policy other than the built-in LRU) calls the reference's method instead.
``tests/store/test_index_native.py`` runs random verb sequences on both indexes and
checks they agree call by call.

The Python :class:`~kvtier.store.index.StoreIndex` is the reference, and the fallback
where no C compiler was found (:func:`make_index`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from kvtier._native import native_enabled
from kvtier.store.index import StoreIndex
from kvtier.store.policy import EvictionFactory, LRUEviction, PlacementPolicy
from kvtier.store.quota import Quotas
from kvtier.store.types import EventKind, StoreEvent
from kvtier.tiers.base import Tier

try:
    if not native_enabled():
        raise ImportError("KVTIER_NATIVE turns the C core off")
    from kvtier import _core
except ImportError:  # built without a C compiler, or turned off: the Python index serves
    _core = None  # type: ignore[assignment]

# The placement hooks the C verbs skip when the placement keeps the default (a no-op).
_SKIPPABLE_HOOKS = ("on_hit",)

if _core is not None:

    class NativeStoreIndex(_core.IndexVerbs, StoreIndex):
        """:class:`StoreIndex`, its hot verbs in C (see the module). Same arguments."""

        _reference = StoreIndex
        _slot = _core.Slot  # type: ignore[assignment]  # same attributes as Slot
        _entry = _core.Entry  # type: ignore[assignment]  # same attributes as Entry
        _event_type = StoreEvent
        _indexed = EventKind.INDEXED
        _unindexed = EventKind.UNINDEXED

        def __init__(
            self,
            tiers: Sequence[Tier],
            eviction: EvictionFactory,
            placement: PlacementPolicy,
            emit: Callable[[StoreEvent], None],
            quotas: Quotas | None = None,
        ) -> None:
            super().__init__(tiers, eviction, placement, emit, quotas)
            # The C verbs keep the books of the built-in LRU and no quotas; otherwise
            # they call the reference's verbs. Both are fixed from here on.
            self._plain = self.books is None and all(type(p) is LRUEviction for p in self._evict)
            kind = type(placement)
            self._hooks = frozenset(
                h for h in _SKIPPABLE_HOOKS if getattr(kind, h) is not getattr(PlacementPolicy, h)
            )

else:
    NativeStoreIndex = None  # type: ignore[assignment,misc]


def make_index(
    tiers: Sequence[Tier],
    eviction: EvictionFactory,
    placement: PlacementPolicy,
    emit: Callable[[StoreEvent], None],
    quotas: Quotas | None = None,
    *,
    native: bool = True,
) -> StoreIndex:
    """The native index where the C core is built (and ``native``), else the reference."""
    cls = NativeStoreIndex if native and NativeStoreIndex is not None else StoreIndex
    return cls(tiers, eviction, placement, emit, quotas)
