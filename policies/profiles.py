"""Tier and GPU profiles, the presets the calculator offers, and their TOML form.

A :class:`TierSpec` is what placement and the calculator need to price one storage
level: latency, bandwidth as a function of transfer size, $/GB-month, endurance and
power. A :class:`Hardware` bundles the GPU (for recompute time and $/GPU-second) with
an ordered stack of tiers, fastest first. Every preset number is sourced or stated as
an assumption in ``docs/cost-model.md``.

Units: seconds, bytes, bytes/second, dollars. Nothing here does I/O except
:func:`load_hardware`, which reads a TOML file.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any

from kvtier.config import read_toml, tier_tables
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
        """The core's :class:`TierProfile` for a simulated tier of this spec."""
        return TierProfile(
            self.latency_s, self.bandwidth_Bps, self.cost_per_gb_month, self.endurance_dwpd
        )


@dataclass(frozen=True, slots=True)
class GPUSpec:
    """The accelerator that recomputes a prefix when it is not cached.

    Attributes:
        name: a label.
        peak_flops: dense BF16 FLOP/s of one GPU.
        mfu: fraction of peak a prefill achieves (model FLOPs utilisation).
        cost_per_hour: $ per GPU-hour.
    """

    name: str
    peak_flops: float
    mfu: float
    cost_per_hour: float

    def __post_init__(self) -> None:
        if self.peak_flops <= 0:
            raise ConfigError("gpu.peak_flops", self.peak_flops, "a number > 0")
        if not 0 < self.mfu <= 1:
            raise ConfigError("gpu.mfu", self.mfu, "in (0, 1]")
        if self.cost_per_hour < 0:
            raise ConfigError("gpu.cost_per_hour", self.cost_per_hour, "a number >= 0")

    @property
    def cost_per_s(self) -> float:
        return self.cost_per_hour / 3600.0


@dataclass(frozen=True, slots=True)
class Hardware:
    """A GPU and the tiers below its HBM, fastest first."""

    name: str
    gpu: GPUSpec
    tiers: tuple[TierSpec, ...]

    def tier(self, name: str) -> TierSpec:
        for t in self.tiers:
            if t.name == name:
                return t
        raise ConfigError("tier", name, f"one of {[t.name for t in self.tiers]}")


# -- presets (sources and assumptions: docs/cost-model.md) ----------------------------------

H200 = GPUSpec("H200 SXM", peak_flops=989e12, mfu=0.5, cost_per_hour=3.5)

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

TIER_PRESETS: dict[str, TierSpec] = {
    "ddr5": DDR5_HOST,
    "cxl2": CXL2_EXPANDER,
    "nvme-tlc": NVME_GEN5_TLC,
    "nvme-qlc": NVME_GEN5_QLC,
    "redis-100gbe": REDIS_100GBE,
}

HARDWARE_PRESETS: dict[str, Hardware] = {
    "h200-dram-nvme": Hardware("h200-dram-nvme", H200, (DDR5_HOST, NVME_GEN5_TLC)),
    "h200-dram-cxl-nvme": Hardware(
        "h200-dram-cxl-nvme", H200, (DDR5_HOST, CXL2_EXPANDER, NVME_GEN5_TLC)
    ),
    "h200-dram-qlc": Hardware("h200-dram-qlc", H200, (DDR5_HOST, replace(NVME_GEN5_QLC))),
    "h200-dram-redis": Hardware("h200-dram-redis", H200, (DDR5_HOST, REDIS_100GBE)),
}


def hardware_preset(name: str) -> Hardware:
    """A preset :class:`Hardware` by name.

    Raises:
        ConfigError: unknown name (the message lists the presets).
    """
    try:
        return HARDWARE_PRESETS[name.lower()]
    except KeyError:
        allowed = f"one of {sorted(HARDWARE_PRESETS)} or a TOML file"
        raise ConfigError("hardware", name, allowed) from None


def load_hardware(source: str | Path) -> Hardware:
    """A preset name, or a TOML file with ``[gpu]`` and ``[[tiers]]`` tables.

    A tier table may name a ``preset`` (see :data:`TIER_PRESETS`) and override fields::

        name = "my-box"
        [gpu]
        peak_flops = 989e12
        mfu = 0.45
        cost_per_hour = 4.0
        [[tiers]]
        preset = "ddr5"
        [[tiers]]
        preset = "nvme-tlc"
        endurance_dwpd = 3.0

    Raises:
        ConfigError: an unreadable file or a bad field; the key names the table and field.
    """
    path = Path(source)
    if not path.suffix and str(source).lower() in HARDWARE_PRESETS:
        return hardware_preset(str(source))
    if not path.exists():
        return hardware_preset(str(source))
    return _hardware_from_dict(read_toml(path, key="hardware"), str(path))


def _hardware_from_dict(raw: dict[str, Any], where: str) -> Hardware:
    gpu_raw = raw.get("gpu", {})
    if not isinstance(gpu_raw, dict):
        raise ConfigError(f"{where}: gpu", gpu_raw, "a [gpu] table")
    base_gpu = {f.name: getattr(H200, f.name) for f in fields(GPUSpec)}
    for key, value in gpu_raw.items():
        if key not in base_gpu:
            raise ConfigError(f"{where}: gpu.{key}", value, f"one of {sorted(base_gpu)}")
        base_gpu[key] = _number(value, f"{where}: gpu.{key}") if key != "name" else str(value)
    gpu = GPUSpec(**base_gpu)
    tiers_raw = raw.get("tiers")
    tiers: list[TierSpec] = []
    names = {f.name for f in fields(TierSpec)}
    for at, t in tier_tables(tiers_raw, f"{where}: tiers"):
        preset_name = t.pop("preset", None)
        if preset_name is not None:
            if preset_name not in TIER_PRESETS:
                raise ConfigError(f"{at}.preset", preset_name, f"one of {sorted(TIER_PRESETS)}")
            base = {f.name: getattr(TIER_PRESETS[preset_name], f.name) for f in fields(TierSpec)}
        else:
            base = {}
        for key, value in t.items():
            if key not in names:
                raise ConfigError(f"{at}.{key}", value, f"one of {sorted(names | {'preset'})}")
            if key == "name":
                base[key] = str(value)
            elif key == "medium":
                try:
                    base[key] = Medium(str(value).lower())
                except ValueError:
                    raise ConfigError(f"{at}.medium", value, "dram, cxl, ssd or remote") from None
            else:
                base[key] = _number(value, f"{at}.{key}")
        missing = (
            names
            - set(base)
            - {"endurance_dwpd", "warranty_years", "device_bytes", "power_w", "write_headroom"}
        )
        if missing:
            raise ConfigError(f"{at}", sorted(missing), "these fields, or a preset")
        tiers.append(TierSpec(**base))
    tier_names = [t.name for t in tiers]
    if len(set(tier_names)) != len(tier_names):
        raise ConfigError(f"{where}: tiers.*.name", tier_names, "unique tier names")
    return Hardware(str(raw.get("name", Path(where).stem)), gpu, tuple(tiers))


def _number(value: object, key: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(key, value, "a number")
    return float(value)
