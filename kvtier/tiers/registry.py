"""Tier kinds: a table from kind name to the module that implements it.

Each module exposes ``Options`` (a frozen dataclass: the kind's config section) and
``create(section, slot_bytes, max_extent_bytes) -> Tier``. Modules import lazily, so a
kind's heavy dependencies (torch, redis, kvikio) load only when the kind is configured.
Third-party kinds register through the ``kvtier.tiers`` entry-point group.
"""

from __future__ import annotations

import importlib
from importlib.metadata import entry_points
from types import ModuleType
from typing import TYPE_CHECKING, Any

from kvtier.errors import ConfigError, PluginError

if TYPE_CHECKING:
    from kvtier.config import TierSection
    from kvtier.tiers.base import Tier

BUILTIN_KINDS: dict[str, str] = {
    "host": "kvtier.tiers.host",
    "cxl": "kvtier.tiers.cxl",
    "gpu": "kvtier.tiers.gpu",
    "nvme": "kvtier.tiers.nvme",
    "meta": "kvtier.tiers.meta",
    "redis": "kvtier.tiers.redis",
}


def _module(kind: str, where: str) -> ModuleType:
    path = BUILTIN_KINDS.get(kind)
    if path is None:
        for ep in entry_points(group="kvtier.tiers"):
            if ep.name == kind:
                path = ep.value
                break
    if path is None:
        raise ConfigError(f"{where}.kind", kind, f"one of {sorted(BUILTIN_KINDS)} or a plugin kind")
    try:
        return importlib.import_module(path)
    except ImportError as exc:
        raise PluginError(f"tier kind {kind!r} ({path}) cannot be imported: {exc}") from exc


def tier_options_class(kind: str, where: str = "tiers") -> type[Any]:
    """The options dataclass that validates a tier section of this kind."""
    options: type[Any] = _module(kind, where).Options
    return options


def is_shared_kind(kind: str) -> bool:
    """Whether tiers of this kind are shared with other processes and hosts (Redis)."""
    module = _module(kind, "tiers")
    return any(
        getattr(obj, "shared", False) is True
        for obj in vars(module).values()
        if isinstance(obj, type) and obj.__module__.startswith(module.__name__)
    )


def create_tier(section: TierSection, slot_bytes: int, max_extent_bytes: int) -> Tier:
    """Build the tier a config section describes."""
    tier: Tier = _module(section.kind, "tiers").create(section, slot_bytes, max_extent_bytes)
    return tier
