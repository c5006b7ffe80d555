"""The ``nvme`` tier: slab files that grow with use, O_DIRECT or kvikio I/O, a crash-safe index.

* :mod:`.engine` moves bytes (``posix``, ``kvikio``; ``uring`` evaluated and dropped);
* :mod:`.journal` keeps the index durable (checkpoint + journal, group commit);
* :mod:`.options` holds the options and enums below;
* :mod:`.tier` is the :class:`~kvtier.tiers.base.Tier` that ties them together.

Config: ``[[tiers]] kind = "nvme"`` with the :class:`Options` below
(docs/configuration.md, "nvme").
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvtier.tiers.nvme.options import Codec, Durability, EngineKind, Options

if TYPE_CHECKING:
    from kvtier.tiers.base import TierGeometry, TierSection
    from kvtier.tiers.nvme.tier import NVMeTier


def create(section: TierSection, geometry: TierGeometry) -> NVMeTier:
    from kvtier.tiers.nvme.tier import NVME_PROFILE, NVMeTier

    return NVMeTier(geometry, section.options, NVME_PROFILE)


__all__ = ["Codec", "Durability", "EngineKind", "Options", "create"]
