"""Plugins by name: one table of the built-ins, entry points for third parties only.

A configuration names its tier kinds, eviction order and placement by name. The names
kvtier ships are resolved from :data:`BUILTIN`, a plain table of import paths, so they
work wherever the code does: an installed wheel, an editable install, or a source tree
on ``PYTHONPATH`` with no package metadata at all. Only a name missing from the table
is looked up in the entry-point group of the same name (``kvtier.tiers``,
``kvtier.eviction``, ``kvtier.placement``), where other distributions add their own.

Paths are strings, imported on first use: a kind's heavy dependencies (torch, redis,
kvikio) load only when it is configured, and the core never imports ``kvtier.policies``
at module level (the store receives its policies through the ABCs of
:mod:`kvtier.store.policy`).
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from importlib.metadata import entry_points
from types import MappingProxyType

from kvtier.errors import ConfigError, PluginError

TIERS = "kvtier.tiers"
EVICTION = "kvtier.eviction"
PLACEMENT = "kvtier.placement"

BUILTIN: Mapping[str, Mapping[str, str]] = MappingProxyType(
    {
        # A tier kind is a module with ``Options`` and ``create`` (kvtier.tiers.registry).
        TIERS: {
            "host": "kvtier.tiers.host",
            "cxl": "kvtier.tiers.cxl",
            "gpu": "kvtier.tiers.gpu",
            "nvme": "kvtier.tiers.nvme",
            "meta": "kvtier.tiers.meta",
            "redis": "kvtier.tiers.redis",
        },
        # An eviction order is a class of no arguments (kvtier.store.policy.EvictionPolicy).
        EVICTION: {
            "lru": "kvtier.store.policy:LRUEviction",
            "arc": "kvtier.policies.eviction:ARCEviction",
            "cost": "kvtier.policies.eviction:CostAwareEviction",
        },
        # A placement is a factory of (tiers, spec, chunk_tokens, settings=...) (PlacementFactory).
        PLACEMENT: {
            "keep": "kvtier.store.policy:keep_everything",
            "cost": "kvtier.policies.wiring:placement_for_tiers",
        },
    }
)


def names(group: str) -> list[str]:
    """Every name ``group`` resolves: the built-ins, then installed plugins."""
    extra = [ep.name for ep in entry_points(group=group) if ep.name not in BUILTIN[group]]
    return sorted(BUILTIN[group]) + sorted(extra)


def path_of(group: str, name: str, where: str) -> str:
    """The import path ``name`` stands for in ``group``.

    Raises:
        ConfigError: no built-in and no installed plugin has that name (``where`` is the
            config key that named it).
    """
    path = BUILTIN[group].get(name)
    if path is None:
        path = next((ep.value for ep in entry_points(group=group) if ep.name == name), None)
    if path is None:
        raise ConfigError(where, name, f"one of {names(group)}")
    return path


def load(group: str, name: str, where: str) -> object:
    """Import what ``name`` stands for in ``group``: a module, or ``module:attribute``.

    Raises:
        ConfigError: an unknown name.
        PluginError: the name is known but its code cannot be imported.
    """
    path = path_of(group, name, where)
    module, _, attr = path.partition(":")
    what = group.rpartition(".")[2]
    try:
        loaded: object = importlib.import_module(module)
        return getattr(loaded, attr) if attr else loaded
    except (ImportError, AttributeError) as exc:
        raise PluginError(f"{what} {name!r} ({path}) cannot be loaded: {exc}") from exc
