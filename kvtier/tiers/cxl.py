"""The ``cxl`` tier: a host arena on a CPU-less NUMA node (CXL-attached memory).

Where the machine has no such node, the tier runs *emulated*: ordinary DRAM, with the
configured latency and bandwidth injected into every transfer, and ``emulated=True`` in
its stats and a warning in the log. That keeps placement decisions and benchmarks honest
about what CXL would cost, without pretending the hardware is there.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from typing_extensions import override

from kvtier.enums import Switch
from kvtier.errors import ConfigError
from kvtier.tiers import numa
from kvtier.tiers.base import SlotRun, TierGeometry, TierProfile, TierSection
from kvtier.tiers.economics import CXL2_EXPANDER
from kvtier.tiers.host import HostTier
from kvtier.tiers.host import Options as HostOptions

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Options:
    """``[[tiers]] kind = "cxl"`` options."""

    # NUMA node of the CXL memory; unset picks the first CPU-less node found in sysfs.
    numa_node: int | None = None
    # auto: emulate only when no CPU-less node exists; on: always emulate; off: require hardware.
    emulate: Switch = Switch.AUTO
    # Emulated access latency (CXL 2.0 expander: ~250 ns over local DRAM's ~100 ns).
    latency_us: float = 0.4
    # Emulated bandwidth of one x16 CXL 2.0 link (PCIe Gen5 electricals), GB/s.
    bandwidth_gbps: float = 64.0
    # Page-lock the arena for CUDA copies: auto, on, off.
    pin: Switch = Switch.AUTO


class CXLTier(HostTier):
    """Host arena on CXL memory, or DRAM with injected latency and bandwidth."""

    kind = "cxl"

    def __init__(
        self,
        geometry: TierGeometry,
        options: Options,
    ) -> None:
        node = options.numa_node
        if node is None and options.emulate is not Switch.ON:
            found = numa.cxl_candidates()
            node = found[0].node_id if found else None
        if node is None and options.emulate is Switch.OFF:
            raise ConfigError(
                f"tiers.{geometry.name}.emulate",
                "off",
                "'auto' or 'on': no CPU-less NUMA node here",
            )
        self._emulated = options.emulate is Switch.ON or node is None
        self._latency_s = options.latency_us * 1e-6
        self._bandwidth_Bps = options.bandwidth_gbps * 1e9
        # Speed as configured (it may be emulated); the price is the table's.
        profile = TierProfile(self._latency_s, self._bandwidth_Bps, CXL2_EXPANDER.cost_per_gb_month)
        host_opts = HostOptions(numa_node=None if self._emulated else node, pin=options.pin)
        super().__init__(geometry, host_opts, profile)
        if self.emulated:
            log.warning(
                "tier %s: no CXL memory in use; EMULATED with %.2f us latency and %.1f GB/s",
                geometry.name,
                options.latency_us,
                options.bandwidth_gbps,
            )
        else:
            log.info("tier %s: CXL memory on NUMA node %s", geometry.name, node)

    @property
    @override
    def emulated(self) -> bool:
        return self._emulated

    def _throttle(self, nbytes: int, started: float) -> None:
        if self.emulated:
            target = self._latency_s + nbytes / self._bandwidth_Bps
            left = target - (time.perf_counter() - started)
            if left > 0:
                time.sleep(left)

    @override
    def slot_view(self, offset: int, nbytes: int) -> memoryview | None:
        # An emulated tier injects its latency into every transfer: no way around it.
        return None if self.emulated else super().slot_view(offset, nbytes)

    @override
    def _write(self, run: SlotRun, src: memoryview) -> None:
        t0 = time.perf_counter()
        super()._write(run, src)
        self._throttle(run.nbytes, t0)

    @override
    def _read(self, run: SlotRun, dst: memoryview) -> None:
        t0 = time.perf_counter()
        super()._read(run, dst)
        self._throttle(run.nbytes, t0)


def create(section: TierSection, geometry: TierGeometry) -> CXLTier:
    return CXLTier(geometry, section.options)
