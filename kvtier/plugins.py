"""Plugins by name: the core's own table, the parts a program composes in, entry points.

A configuration names its tier kinds, eviction order and placement by name. A name
resolves from, in order:

1. :data:`BUILTIN`, the core's own names: a plain table of import paths, so they work
   wherever the code does (an installed wheel, an editable install, a source tree on
   ``PYTHONPATH`` with no package metadata at all);
2. the names a program composed in with :func:`compose`: the program that runs a store
   (kvtier's CLI, its daemon, its engine connectors) adds the parts it ships beside the
   core, as ``kvtier.policies`` adds ``placement = "cost"`` and ``eviction = "arc"``;
3. the entry-point group of the same name (``kvtier.tiers``, ``kvtier.eviction``,
   ``kvtier.placement``), where other distributions add their own.

The core names none of the parts above it: what it resolves on its own, its defaults
included (:func:`default`), needs nothing but the core. Paths are strings, imported on
first use, so a kind's heavy dependencies (torch, redis, kvikio) load only when it is
configured.
"""

from __future__ import annotations

import importlib
import threading
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
        },
        # A placement is a factory of (tiers, spec, chunk_tokens, settings=...) (PlacementFactory).
        PLACEMENT: {
            "keep": "kvtier.store.policy:keep_everything",
        },
    }
)

# What ``store.placement`` names when a configuration names nothing and no composed part
# chose otherwise: the core's own write-through.
CORE_DEFAULTS: Mapping[str, str] = MappingProxyType({PLACEMENT: "keep"})

_lock = threading.Lock()
_composed: dict[str, dict[str, str]] = {group: {} for group in BUILTIN}
_defaults: dict[str, str] = {}


def compose(
    names: Mapping[str, Mapping[str, str]], defaults: Mapping[str, str] | None = None
) -> None:
    """Add a part's names to this process's table, and its choice of defaults.

    Called by the program that runs a store, before it loads a configuration, once for
    each part it ships beside the core (``kvtier.policies.compose`` does it for the
    policies). Composing the same names again changes nothing.

    Args:
        names: group -> name -> import path (``module`` or ``module:attribute``).
        defaults: group -> the name a configuration gets when it names none; the name
            must be the core's or composed (here or before).

    Raises:
        PluginError: a name the core defines or a part composed with another path, a
            default composed before as another name, or an unknown group; nothing is
            composed then.
    """
    defaults = defaults or {}
    with _lock:
        for group, table in names.items():
            if group not in BUILTIN:
                raise PluginError(f"no plugin group {group!r}; one of {sorted(BUILTIN)}")
            for name, path in table.items():
                if name in BUILTIN[group]:
                    raise PluginError(f"{group} {name!r} is the core's own; it is not composed")
                held = _composed[group].get(name, path)
                if held != path:
                    raise PluginError(f"{group} {name!r} is already {held}, not {path}")
        for group, name in defaults.items():
            if group not in CORE_DEFAULTS:
                raise PluginError(f"no default for group {group!r}; one of {sorted(CORE_DEFAULTS)}")
            known = {*BUILTIN[group], *_composed[group], *names.get(group, {})}
            if name not in known:
                raise PluginError(f"the default {group} {name!r} is not a name of {group}")
            held = _defaults.get(group, name)
            if held != name:
                raise PluginError(f"the default {group} is already {held!r}, not {name!r}")
        # Checked in full first: a refused call composes nothing.
        for group, table in names.items():
            _composed[group].update(table)
        _defaults.update(defaults)


def default(group: str) -> str:
    """The name a configuration takes for ``group`` when it names none."""
    with _lock:
        return _defaults.get(group, CORE_DEFAULTS[group])


def names(group: str) -> list[str]:
    """Every name ``group`` resolves: the core's, the composed parts', installed plugins'."""
    with _lock:
        known = sorted(BUILTIN[group]) + sorted(_composed[group])
    extra = [ep.name for ep in entry_points(group=group) if ep.name not in known]
    return known + sorted(extra)


def path_of(group: str, name: str, where: str) -> str:
    """The import path ``name`` stands for in ``group``.

    Raises:
        ConfigError: neither the core, nor a composed part, nor an installed plugin has
            that name (``where`` is the config key that named it).
    """
    with _lock:
        path = BUILTIN[group].get(name) or _composed[group].get(name)
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
