"""The one table of tier economics: what each medium costs and how fast it is.

A :class:`TierSpec` prices one storage level: latency, bandwidth as a function of
transfer size, $/GB-month, endurance and power. The presets below are the only figures
kvtier holds for real media: a live tier takes its :class:`~kvtier.tiers.base.TierProfile`
from its kind's entry (``HOST_PROFILE``, ``NVME_PROFILE``, ...), placement prices the
store's tiers with them, and ``kvtier calc`` sizes tiers with them, so a plan and the
store it configures reason with the same prices.

Prices are capex amortised over the warranty (36 months for memory, 60 for SSDs), not
cloud rental: every medium in one unit, so the ratios between tiers are what placement
acts on. Each figure's source or assumption is in ``docs/cost-model.md`` (section 4);
change them for a machine in a hardware TOML (``kvtier calc --hardware``,
``placement.hardware``).

Units: seconds, bytes, bytes/second, dollars. Nothing here does I/O.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from kvtier.errors import ConfigError
from kvtier.tiers.base import TierProfile
from kvtier.units import KiB

GB = 1e9
SECONDS_PER_MONTH = 30 * 86400.0
SECONDS_PER_DAY = 86400.0


class Medium(enum.Enum):
    """What a tier is made of; decides whether writes wear it out."""

    DRAM = "dram"
    CXL = "cxl"
    SSD = "ssd"
    REMOTE = "remote"


@dataclass(frozen=True, slots=True)
class TierSpec:
    """Economics and speed of one storage level.

    Attributes:
        name: tier name (matches the store's tier name in a simulation).
        medium: what it is made of.
        latency_s: median time to first byte of a read (includes DMA/IO setup).
        p99_latency_s: 99th-percentile access latency (the seed matrix checks it).
        bandwidth_Bps: peak sustained bytes/second of large transfers to the GPU.
        half_bandwidth_bytes: transfer size at which half of ``bandwidth_Bps`` is reached;
            effective bandwidth is ``peak * n / (n + half)``.
        cost_per_gb_month: $ per GB (1e9 bytes) per month, capex amortised plus power.
        endurance_dwpd: rated drive writes per day; 0 means no wear limit.
        warranty_years: years over which ``endurance_dwpd`` is rated.
        device_bytes: capacity of one device (for power and the seed formula).
        power_w: power of one device, watts.
        write_headroom: fraction of the rated endurance that admission may spend.
    """

    name: str
    medium: Medium
    latency_s: float
    p99_latency_s: float
    bandwidth_Bps: float
    half_bandwidth_bytes: float
    cost_per_gb_month: float
    endurance_dwpd: float = 0.0
    warranty_years: float = 5.0
    device_bytes: float = 0.0
    power_w: float = 0.0
    write_headroom: float = 0.8

    def __post_init__(self) -> None:
        for f in (
            "latency_s",
            "p99_latency_s",
            "half_bandwidth_bytes",
            "cost_per_gb_month",
            "endurance_dwpd",
            "device_bytes",
            "power_w",
        ):
            if getattr(self, f) < 0:
                raise ConfigError(f"tiers.{self.name}.{f}", getattr(self, f), "a number >= 0")
        if self.bandwidth_Bps <= 0:
            raise ConfigError(f"tiers.{self.name}.bandwidth_Bps", self.bandwidth_Bps, "> 0")
        if not 0 < self.write_headroom <= 1:
            raise ConfigError(f"tiers.{self.name}.write_headroom", self.write_headroom, "in (0, 1]")
        if self.warranty_years <= 0:
            raise ConfigError(f"tiers.{self.name}.warranty_years", self.warranty_years, "> 0")

    @property
    def wears(self) -> bool:
        """True when writes consume a rated endurance."""
        return self.endurance_dwpd > 0

    def bandwidth_at(self, transfer_bytes: float) -> float:
        """Effective bytes/second of one transfer of ``transfer_bytes``."""
        n = max(transfer_bytes, 1.0)
        return self.bandwidth_Bps * n / (n + self.half_bandwidth_bytes)

    def load_time_s(self, nbytes: float, transfers: int = 1) -> float:
        """Seconds to move ``nbytes`` to the GPU in ``transfers`` equal transfers, serially."""
        if nbytes <= 0:
            return 0.0
        per = nbytes / max(transfers, 1)
        return transfers * self.latency_s + nbytes / self.bandwidth_at(per)

    def write_budget_Bps(self, capacity_bytes: float) -> float:
        """Bytes/second admission may write: DWPD x capacity x headroom / day. inf if no wear."""
        if not self.wears:
            return float("inf")
        return self.endurance_dwpd * capacity_bytes * self.write_headroom / SECONDS_PER_DAY

    def tbw_bytes(self, capacity_bytes: float) -> float:
        """Total bytes the capacity may be written over the warranty (inf if no wear)."""
        if not self.wears:
            return float("inf")
        return self.endurance_dwpd * capacity_bytes * 365.0 * self.warranty_years

    def wear_cost_per_byte(self) -> float:
        """$ of endurance one written byte consumes: the medium's price over its TBW."""
        if not self.wears:
            return 0.0
        price_per_byte = self.cost_per_gb_month / GB * 12 * self.warranty_years
        return price_per_byte / (self.endurance_dwpd * 365.0 * self.warranty_years)

    def storage_cost_per_byte_s(self) -> float:
        """$ per byte per second of holding data."""
        return self.cost_per_gb_month / GB / SECONDS_PER_MONTH

    def to_tier_profile(self) -> TierProfile:
        """The :class:`TierProfile` a tier of this medium reports (live or simulated)."""
        return TierProfile(
            self.latency_s, self.bandwidth_Bps, self.cost_per_gb_month, self.endurance_dwpd
        )


# -- the table (sources and assumptions: docs/cost-model.md, section 4) -----------------------

# Host DRAM behind PCIe Gen5 x16. Bandwidth is the measured pinned-copy ceiling (55 GB/s;
# 64 KiB copies reach 10.5 GB/s, 2 MiB 52 GB/s: the 128 KiB half-bandwidth size fits
# both); latency is the per-copy setup, rounded up. Price: DDR5 RDIMM at ~$7/GB over 36
# months.
DDR5_HOST = TierSpec(
    "host",
    Medium.DRAM,
    latency_s=10e-6,
    p99_latency_s=20e-6,
    bandwidth_Bps=55e9,
    half_bandwidth_bytes=128 * KiB,
    cost_per_gb_month=0.20,
    device_bytes=64e9,
    power_w=6.0,
)
# A CXL 2.0 x16 expander: the Gen5 x16 link per direction; DIMMs behind the controller
# cost less than host DRAM.
CXL2_EXPANDER = TierSpec(
    "cxl",
    Medium.CXL,
    latency_s=12e-6,
    p99_latency_s=22e-6,
    bandwidth_Bps=64e9,
    half_bandwidth_bytes=128 * KiB,
    cost_per_gb_month=0.15,
    device_bytes=256e9,
    power_w=25.0,
)
# A datacenter Gen5 TLC drive (Micron 9550 PRO / Kioxia CM7-R class): 14 GB/s read,
# 1 drive write a day for 5 years. Price: $0.15/GB over 60 months.
NVME_GEN5_TLC = TierSpec(
    "nvme",
    Medium.SSD,
    latency_s=80e-6,
    p99_latency_s=250e-6,
    bandwidth_Bps=14e9,
    half_bandwidth_bytes=1024 * KiB,
    cost_per_gb_month=0.0025,
    endurance_dwpd=1.0,
    warranty_years=5.0,
    device_bytes=7.68e12,
    power_w=25.0,
)
# A Gen5 QLC drive (Solidigm D5-P5336 class): 0.3 DWPD taken, the conservative end.
# Price: $0.07/GB over 60 months.
NVME_GEN5_QLC = TierSpec(
    "nvme",
    Medium.SSD,
    latency_s=120e-6,
    p99_latency_s=500e-6,
    bandwidth_Bps=12e9,
    half_bandwidth_bytes=2048 * KiB,
    cost_per_gb_month=0.0012,
    endurance_dwpd=0.3,
    warranty_years=5.0,
    device_bytes=61.44e12,
    power_w=25.0,
)
# Redis on another server over 100 GbE: ~80% of the 12.5 GB/s line rate; the remote
# DRAM plus its share of the server and the network.
REDIS_100GBE = TierSpec(
    "redis",
    Medium.REMOTE,
    latency_s=60e-6,
    p99_latency_s=300e-6,
    bandwidth_Bps=10e9,
    half_bandwidth_bytes=512 * KiB,
    cost_per_gb_month=0.35,
    device_bytes=512e9,
    power_w=400.0,
)

# A managed Redis in the same zone over 10 GbE: the default of a live redis tier, which
# more often meets a shared cache service than a dedicated 100 GbE server. Managed
# in-memory stores are priced by the GB of memory reserved.
REDIS_10GBE_MANAGED = TierSpec(
    "redis",
    Medium.REMOTE,
    latency_s=250e-6,
    p99_latency_s=1e-3,
    bandwidth_Bps=1.2e9,
    half_bandwidth_bytes=512 * KiB,
    cost_per_gb_month=10.0,
    device_bytes=64e9,
)

# Preset name (a hardware TOML's ``preset = ...``) -> spec.
TIER_PRESETS: dict[str, TierSpec] = {
    "ddr5": DDR5_HOST,
    "cxl2": CXL2_EXPANDER,
    "nvme-tlc": NVME_GEN5_TLC,
    "nvme-qlc": NVME_GEN5_QLC,
    "redis-100gbe": REDIS_100GBE,
    "redis-10gbe-managed": REDIS_10GBE_MANAGED,
}
