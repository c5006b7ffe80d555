"""GPU profiles, the hardware presets the calculator offers, and their TOML form.

A :class:`Hardware` bundles the GPU (for recompute time and $/GPU-second) with an
ordered stack of tiers, fastest first. The tiers' prices and speeds come from the one
table of tier economics in the core, :mod:`kvtier.tiers.economics` (re-exported here),
which the live tiers use too. Every preset number is sourced or stated as an assumption
in ``docs/cost-model.md``.

Units: seconds, bytes, bytes/second, dollars. Nothing here does I/O except
:func:`load_hardware`, which reads a TOML file.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any

from kvtier.config import read_toml, tier_tables
from kvtier.errors import ConfigError
from kvtier.tiers.economics import (
    CXL2_EXPANDER,
    DDR5_HOST,
    NVME_GEN5_QLC,
    NVME_GEN5_TLC,
    REDIS_100GBE,
    TIER_PRESETS,
    Medium,
    TierSpec,
)

__all__ = [
    "CXL2_EXPANDER",
    "DDR5_HOST",
    "H200",
    "HARDWARE_PRESETS",
    "NVME_GEN5_QLC",
    "NVME_GEN5_TLC",
    "REDIS_100GBE",
    "TIER_PRESETS",
    "GPUSpec",
    "Hardware",
    "Medium",
    "TierSpec",
    "hardware_preset",
    "load_hardware",
]


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
