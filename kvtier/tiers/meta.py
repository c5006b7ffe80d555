"""The ``meta`` tier: allocation and accounting without bytes, for simulation only.

A metadata tier runs the real allocator, counters and profile of a tier but moves no
bytes: ``_write`` keeps nothing and ``_read`` leaves the destination untouched. The
trace simulator (``kvtier.policies.simulate``) stacks these so the real store's index,
eviction, demotion and promotion run at full speed on traces whose KV would not fit
in any machine.

Never configure it under an engine: a read returns no KV. ``create`` logs a warning
for that reason, and the contract suite leaves it out (it cannot round-trip bytes).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from typing_extensions import override

from kvtier.tiers.base import SlotRun, Tier, TierGeometry, TierProfile, TierSection

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Options:
    """``[[tiers]] kind = "meta"`` options: the profile the simulated tier stands for."""

    # Time to first byte of a read, microseconds.
    latency_us: float = 0.0
    # Sustained bandwidth of large transfers, GB/s.
    bandwidth_gbps: float = 10.0
    # Storage price, $/GB-month.
    cost_per_gb_month: float = 0.0
    # Rated drive writes per day; 0 means unlimited (memory).
    endurance_dwpd: float = 0.0


class MetaTier(Tier):
    """A tier that keeps books but no bytes (simulation only)."""

    kind = "meta"

    @property
    @override
    def emulated(self) -> bool:
        return True

    @override
    def _write(self, run: SlotRun, src: memoryview) -> None:
        pass  # metadata only: the allocation and the counters are what is simulated

    @override
    def _read(self, run: SlotRun, dst: memoryview) -> None:
        pass  # no bytes to return; callers of a simulation never use the buffer


def create(section: TierSection, geometry: TierGeometry) -> MetaTier:
    opts: Options = section.options
    log.warning("tier %s: kind 'meta' stores no bytes; use it for simulation only", section.name)
    profile = TierProfile(
        latency_s=opts.latency_us * 1e-6,
        bandwidth_Bps=opts.bandwidth_gbps * 1e9,
        cost_per_gb_month=opts.cost_per_gb_month,
        endurance_dwpd=opts.endurance_dwpd,
    )
    return MetaTier(geometry, profile)
