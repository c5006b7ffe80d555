"""One table of tier economics: the live tiers, placement and the calculator agree."""

from __future__ import annotations

from pathlib import Path

from kvtier.config import load_config
from kvtier.policies.profiles import HARDWARE_PRESETS
from kvtier.policies.wiring import priced_specs
from kvtier.tiers.base import Tier
from kvtier.tiers.economics import DDR5_HOST, NVME_GEN5_TLC, TIER_PRESETS
from kvtier.tiers.registry import create_tier


def _host_and_nvme(tmp_path: Path) -> list[Tier]:
    cfg = load_config(
        env={},
        overrides=[
            "tiers.0.capacity_bytes=64MiB",
            "tiers.0.pin=off",
            "tiers.1.kind=nvme",
            f"tiers.1.dir={tmp_path}",
            "tiers.1.capacity_bytes=64MiB",
        ],
    )
    return [create_tier(s, 1 << 20, 4 << 20) for s in cfg.tiers]


def test_live_tiers_report_the_table_entries(tmp_path: Path) -> None:
    tiers = _host_and_nvme(tmp_path)
    try:
        assert [t.profile for t in tiers] == [
            DDR5_HOST.to_tier_profile(),
            NVME_GEN5_TLC.to_tier_profile(),
        ]
    finally:
        for t in tiers:
            t.close()


def test_placement_prices_live_tiers_as_the_calculator_does(tmp_path: Path) -> None:
    # With the default hardware preset, and with none (each tier's own profile), the
    # store's tiers get the calculator's specs of h200-dram-nvme.
    calc = HARDWARE_PRESETS["h200-dram-nvme"].tiers
    tiers = _host_and_nvme(tmp_path)
    try:
        for hardware in ("h200-dram-nvme", ""):
            assert priced_specs(tiers, hardware) == list(calc), hardware
    finally:
        for t in tiers:
            t.close()


def test_every_hardware_preset_uses_the_table() -> None:
    for hw in HARDWARE_PRESETS.values():
        for spec in hw.tiers:
            assert spec in TIER_PRESETS.values(), (hw.name, spec.name)
