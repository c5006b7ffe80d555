"""What ``kvtier.policies`` adds to a program: its names, and the default placement.

A program that runs a store and ships the policies (kvtier's CLI, daemon, engine
connectors and benchmarks) calls :func:`compose` before it loads a configuration; the
core itself never names this package (docs/architecture.md).
"""

from __future__ import annotations

from collections.abc import Mapping

from kvtier import plugins

# Import paths, imported on first use (the core's plugin table, :mod:`kvtier.plugins`).
NAMES: Mapping[str, Mapping[str, str]] = {
    plugins.EVICTION: {
        "arc": "kvtier.policies.eviction:ARCEviction",
        "cost": "kvtier.policies.eviction:CostAwareEviction",
    },
    plugins.PLACEMENT: {
        "cost": "kvtier.policies.wiring:placement_for_tiers",
    },
}
# Where the policies are composed in, a store is a cache that spends SSD endurance as a
# budget unless its configuration says otherwise (docs/cost-model.md).
DEFAULTS: Mapping[str, str] = {plugins.PLACEMENT: "cost"}


def compose() -> None:
    """Add the policies' names to this process, and make ``cost`` the default placement.

    Idempotent; call it before loading a configuration.
    """
    plugins.compose(NAMES, DEFAULTS)
