"""Issue 11, item 7: every bad value is one line naming the key (ConfigError; the CLI
exits 2), never a traceback or an unbounded allocation."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from kvtier.config import default_toml, load_config
from kvtier.errors import ConfigError
from kvtier.service.tenants import load_or_create_salt


def _raw(**tier: object) -> dict[str, object]:
    raw = default_toml()
    raw["tiers"] = [{"kind": "host", "capacity_bytes": "1GiB", **tier}]
    return raw


@pytest.mark.parametrize(
    ("kwargs", "key"),
    [
        ({"base": _raw(capacity_bytes=1e30)}, "tiers.0.capacity_bytes"),
        ({"overrides": ["service.shutdown_timeout_s=nan"]}, "service.shutdown_timeout_s"),
        ({"overrides": ["service.shutdown_timeout_s=inf"]}, "service.shutdown_timeout_s"),
        ({"overrides": ["service.inflight_wait_s=-1"]}, "service.inflight_wait_s"),
        ({"overrides": ["service.inflight_wait_s=nan"]}, "service.inflight_wait_s"),
        ({"env": {"KVTIER_LOG_LEVEL__X__Y": "1"}}, "KVTIER_LOG_LEVEL__X__Y"),
        ({"overrides": ["tiers.100000000.kind=host"]}, "--set tiers.100000000.kind"),
        ({"overrides": ["tiers.0.name=../escaped"]}, "tiers.0.name"),
        ({"overrides": ["tiers.0.name=a/b"]}, "tiers.0.name"),
        ({"overrides": ["tenants.quotas.alice.ssd=1GiB"]}, "tenants.quotas.alice.ssd"),
        ({"overrides": ["tenants.quotas.Alice!.host=1GiB"]}, "tenants.quotas.Alice!"),
        ({"overrides": ["tenants.default_quota.host=lots"]}, "tenants.default_quota.host"),
    ],
)
def test_bad_values_are_config_errors_naming_the_key(kwargs: dict, key: str) -> None:
    kwargs.setdefault("env", {})
    with pytest.raises(ConfigError) as info:
        load_config(**kwargs)
    assert info.value.key == key
    assert "\n" not in str(info.value)


def test_quotas_by_tier_position() -> None:
    cfg = load_config(
        env={
            "KVTIER_TENANTS__QUOTAS__ALICE__HOST": "2GiB",
            "KVTIER_TENANTS__DEFAULT_QUOTA__HOST": "1GiB",
        }
    )
    assert cfg.tenants.enabled
    assert cfg.tenants.limits(["host"]) == ({"alice": {0: 2 << 30}}, {0: 1 << 30})
    assert not load_config(env={}).tenants.enabled


def test_key_salt_that_is_a_directory_is_a_config_error(tmp_path: Path) -> None:
    (tmp_path / "key_salt").mkdir()
    with pytest.raises(ConfigError, match=r"service\.data_dir"):
        load_or_create_salt(tmp_path / "key_salt")


def test_key_salt_on_a_read_only_filesystem_is_a_config_error(tmp_path: Path) -> None:
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("mounting a read-only tmpfs needs root")
    mnt = tmp_path / "ro"
    mnt.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(mnt)])
    if r.returncode != 0:
        pytest.skip("cannot mount a tmpfs here")
    try:
        with pytest.raises(ConfigError, match="writable"):
            load_or_create_salt(mnt / "data" / "key_salt")
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def test_an_empty_key_salt_is_refused_not_replaced(tmp_path: Path) -> None:
    (tmp_path / "key_salt").write_text("\n")
    with pytest.raises(ConfigError, match="non-empty"):
        load_or_create_salt(tmp_path / "key_salt")


def test_key_salt_directories_are_private(tmp_path: Path) -> None:
    salt = load_or_create_salt(tmp_path / "a" / "b" / "key_salt")
    assert salt
    assert (tmp_path / "a").stat().st_mode & 0o777 == 0o700
    assert (tmp_path / "a" / "b").stat().st_mode & 0o777 == 0o700
    assert (tmp_path / "a" / "b" / "key_salt").stat().st_mode & 0o777 == 0o600


def test_the_cli_answers_a_bad_value_with_one_line_and_exit_2(tmp_path: Path) -> None:
    r = subprocess.run(
        [
            *(sys.executable, "-m", "kvtier.cli.main", "serve", "--port", "0"),
            *("--set", "service.data_dir=", "--set", "service.shutdown_timeout_s=nan"),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 2, r.stderr
    assert "service.shutdown_timeout_s" in r.stderr
    assert "Traceback" not in r.stderr
