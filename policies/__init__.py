"""kvtier's policies: where each block of KV lives, and the planning tool built on them.

Small modules, each one concern (see docs/cost-model.md):

* ``profiles`` GPU specs, hardware presets and their TOML (the tiers' prices and speeds:
  ``kvtier.tiers.economics``); ``measure`` profiles this machine;
* ``recompute`` prefill time (with its attention term) and $/GPU-second;
* ``reuse`` online reuse evidence; ``budget`` the SSD write budget;
* ``placement`` cost-aware placement, admission and promotion (a core ``PlacementPolicy``);
  ``wiring`` builds it for a live store;
* ``eviction`` ARC and cost-aware eviction orders (``eviction = "arc" | "cost"``);
* ``seed`` the seed document's CXL-SSD formula and threshold matrix;
* ``trace``, ``simulate``, ``validate`` the trace simulator and its check against real bytes;
* ``calc``, ``plots`` the offline calculator behind ``kvtier calc``;
* ``plugins`` the names and the default this package adds to a program (:func:`compose`).

The core never imports this package. A program that runs a store with the policies
calls :func:`compose` (``plugins``) first, so that a configuration's ``placement =
"cost"`` and ``eviction = "arc"`` resolve and ``cost`` is the default placement: the CLI
(the composition root), the daemon, the engine connectors and the benchmarks do.
"""

from kvtier.policies.plugins import compose

__all__ = ["compose"]
