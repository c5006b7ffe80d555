"""kvtier's policies: where each block of KV lives, and the planning tool built on them.

Small modules, each one concern (see docs/cost-model.md):

* ``profiles`` tier and GPU specs, presets, hardware TOML; ``measure`` profiles this machine;
* ``recompute`` prefill time (with its attention term) and $/GPU-second;
* ``reuse`` online reuse evidence; ``budget`` the SSD write budget;
* ``placement`` cost-aware placement, admission and promotion (a core ``PlacementPolicy``);
  ``wiring`` builds it for a live store;
* ``eviction`` ARC and cost-aware eviction orders (``kvtier.eviction`` entry points);
* ``seed`` the seed document's CXL-SSD formula and threshold matrix;
* ``trace``, ``simulate``, ``validate`` the trace simulator and its check against real bytes;
* ``calc``, ``plots`` the offline calculator behind ``kvtier calc``.

The core never imports this package; the CLI and other composition roots do, lazily.
"""
