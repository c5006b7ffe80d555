"""Tier kinds: a table from kind name to the module that implements it.

Each module exposes ``Options`` (a frozen dataclass: the kind's config section) and
``create(section, geometry) -> Tier``. Modules import lazily, so a
kind's heavy dependencies (torch, redis, kvikio) load only when the kind is configured.
The table is :data:`kvtier.plugins.BUILTIN`; third-party kinds register through the
``kvtier.tiers`` entry-point group.
"""

from __future__ import annotations

from types import ModuleType
from typing import TYPE_CHECKING, Any, cast

from kvtier import plugins
from kvtier.tiers.base import SharedTier, TierGeometry

if TYPE_CHECKING:
    from kvtier.tiers.base import Tier, TierSection

BUILTIN_KINDS = plugins.BUILTIN[plugins.TIERS]


def _module(kind: str, where: str) -> ModuleType:
    return cast(ModuleType, plugins.load(plugins.TIERS, kind, f"{where}.kind"))


def tier_options_class(kind: str, where: str = "tiers") -> type[Any]:
    """The options dataclass that validates a tier section of this kind."""
    options: type[Any] = _module(kind, where).Options
    return options


def is_shared_kind(kind: str) -> bool:
    """Whether tiers of this kind are shared with other processes and hosts (Redis): the
    kind's module defines a :class:`~kvtier.tiers.base.SharedTier`."""
    module = _module(kind, "tiers")
    return any(
        issubclass(obj, SharedTier)
        for obj in vars(module).values()
        if isinstance(obj, type) and obj.__module__.startswith(module.__name__)
    )


def create_tier(section: TierSection, slot_bytes: int, max_extent_bytes: int) -> Tier:
    """Build the tier a config section describes, at the store's slot size and extent cap."""
    geometry = TierGeometry(section.name, section.capacity_bytes, slot_bytes, max_extent_bytes)
    tier: Tier = _module(section.kind, "tiers").create(section, geometry)
    return tier
