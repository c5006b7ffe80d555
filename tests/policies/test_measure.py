"""``kvtier info --profile``: the fit of measured bandwidths, and the TOML it writes."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvtier.errors import ConfigError
from kvtier.policies.measure import Measured, fit, measure_disk, to_toml
from kvtier.policies.profiles import Medium, load_hardware


def test_fit_recovers_peak_and_half_size() -> None:
    peak, half = 50e9, 128 * 1024
    curve = {n: peak * n / (n + half) for n in (64 << 10, 256 << 10, 2 << 20, 16 << 20)}
    got_peak, got_half = fit(curve)
    assert got_peak == pytest.approx(peak, rel=1e-6)
    assert got_half == pytest.approx(half, rel=1e-6)


def test_profile_toml_loads_as_hardware(tmp_path: Path) -> None:
    m = Measured({65536: 9e9}, 20e9, 65536.0, 1.5e9, 1.8e9, False, "/tmp")
    f = tmp_path / "local.toml"
    f.write_text(to_toml(m))
    hw = load_hardware(f)
    assert [t.medium for t in hw.tiers] == [Medium.DRAM, Medium.SSD]
    assert hw.tiers[0].bandwidth_Bps == pytest.approx(20e9)
    assert hw.tiers[1].bandwidth_Bps == pytest.approx(1.5e9)
    assert hw.tiers[1].endurance_dwpd > 0


def test_disk_probe_reads_back_what_it_wrote(tmp_path: Path) -> None:
    write, read, _ = measure_disk(tmp_path, total_bytes=32 << 20)
    assert write > 0 and read > 0


def test_a_bad_hardware_file_names_the_hardware_setting(tmp_path: Path) -> None:
    f = tmp_path / "bad.toml"
    f.write_text("[gpu\n")
    with pytest.raises(ConfigError, match="valid TOML") as exc:
        load_hardware(f)
    assert exc.value.key == "hardware" and exc.value.value == str(f)
    unreadable = tmp_path / "dir.toml"
    unreadable.mkdir()
    with pytest.raises(ConfigError, match="readable TOML") as exc:
        load_hardware(unreadable)
    assert exc.value.key == "hardware"
