"""The store's policy contracts. ``kvtier.policies`` implements them; the core never imports it.

Two narrow ABCs:

* :class:`EvictionPolicy` orders one tier's chunks, coldest first.
* :class:`PlacementPolicy` decides where a new chunk goes, and where a victim goes
  when its tier needs room (one tier down, or dropped). The store lets it see free room
  and coldest chunks of every tier through a read-only :class:`TierView`.

Policies are called under the store's lock: they must be fast and must not call back
into the store. Eviction is atomic at the store level: a make-room pass frees exactly
the victims it marked, or leaves every chunk where it was.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from typing import Protocol, cast

from typing_extensions import override

from kvtier import plugins
from kvtier.keys import ChunkKey
from kvtier.store.types import PolicyCount


class EvictionPolicy(ABC):
    """Keeps the eviction order of one tier's chunks."""

    @abstractmethod
    def insert(self, key: ChunkKey, nbytes: int) -> None:
        """A chunk now lives in this tier."""

    @abstractmethod
    def touch(self, key: ChunkKey) -> None:
        """A chunk of this tier was hit."""

    @abstractmethod
    def remove(self, key: ChunkKey) -> None:
        """A chunk left this tier (evicted, moved or deleted). Unknown keys are ignored."""

    @abstractmethod
    def candidates(self) -> Iterator[ChunkKey]:
        """This tier's chunks, best victim first. The store skips pinned and busy ones."""


class LRUEviction(EvictionPolicy):
    """Least recently used first."""

    def __init__(self) -> None:
        self._order: OrderedDict[ChunkKey, None] = OrderedDict()

    @override
    def insert(self, key: ChunkKey, nbytes: int) -> None:
        self._order[key] = None
        self._order.move_to_end(key)

    @override
    def touch(self, key: ChunkKey) -> None:
        if key in self._order:
            self._order.move_to_end(key)

    @override
    def remove(self, key: ChunkKey) -> None:
        self._order.pop(key, None)

    @override
    def candidates(self) -> Iterator[ChunkKey]:
        return iter(self._order)  # the store never mutates while it iterates


class TierView(Protocol):
    """What a placement may see of the store's tiers. Called under the store's lock."""

    def free_slots(self, tier: int) -> int:
        """Slots of ``tier`` free now."""
        ...

    def coldest(self, tier: int, n: int) -> Sequence[ChunkKey]:
        """Up to ``n`` chunks ``tier`` would evict next (pinned and busy ones skipped)."""
        ...

    def stored_bytes(self, keys: Sequence[ChunkKey]) -> int:
        """Bytes of value the indexed chunks among ``keys`` hold (what moving them writes)."""
        ...


class PlacementPolicy(ABC):  # noqa: B024 - every hook has a sane default; subclass what you need
    """Where chunks go. The default keeps everything and demotes one tier at a time."""

    def bind(self, view: TierView) -> None:  # noqa: B027 - optional hook
        """The store this policy drives was built; ``view`` shows its tiers' room."""

    def admit(self, tier: int, keys: Sequence[ChunkKey], value_bytes: int) -> bool:
        """May these new chunks be written into ``tier``? Default: yes."""
        return True

    def demote_target(self, tier: int, n_tiers: int, keys: Sequence[ChunkKey]) -> int | None:
        """Tier that victims of ``tier`` move to, or None to drop them."""
        return tier + 1 if tier + 1 < n_tiers else None

    def on_hit(self, tier: int, keys: Sequence[ChunkKey]) -> None:  # noqa: B027 - optional hook
        """Chunks were served from ``tier`` (reuse evidence)."""

    def on_miss(self, keys: Sequence[ChunkKey]) -> None:  # noqa: B027 - optional hook
        """Chunks were looked up and absent (ghost-list evidence)."""

    def should_promote(self, tier: int, keys: Sequence[ChunkKey]) -> bool:
        """Move chunks hit in ``tier`` (> 0) up to the top tier? Default: yes."""
        return True

    def report(self) -> Sequence[PolicyCount]:
        """What this policy decided so far, for the store's stats. Default: nothing."""
        return ()


class WriteThrough(PlacementPolicy):
    """Keep everything, demote tier by tier: what the peers do (the baseline policy)."""


EvictionFactory = Callable[[], EvictionPolicy]
PlacementFactory = Callable[..., PlacementPolicy]
"""Builds a placement from ``(tiers, spec, chunk_tokens)`` of the store it will drive, with
keywords ``settings`` (the ``[placement]`` section) and, when replaying a trace, ``clock``."""


def keep_everything(*_args: object, **_kwargs: object) -> PlacementPolicy:
    """The ``keep`` placement: :class:`WriteThrough`, whatever the store."""
    return WriteThrough()


def placement_factory(name: str) -> PlacementFactory:
    """Resolve a placement by name (:data:`kvtier.plugins.BUILTIN`, then plugins)."""
    return cast(PlacementFactory, plugins.load(plugins.PLACEMENT, name, "store.placement"))


def eviction_factory(name: str) -> EvictionFactory:
    """Resolve an eviction policy by name (:data:`kvtier.plugins.BUILTIN`, then plugins)."""
    return cast(EvictionFactory, plugins.load(plugins.EVICTION, name, "store.eviction"))
