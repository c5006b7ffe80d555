"""Plugins by name: built-ins from one table, entry points only for third parties."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from kvtier import plugins
from kvtier.errors import ConfigError
from kvtier.policies.eviction import ARCEviction
from kvtier.store.policy import WriteThrough, eviction_factory, placement_factory

ROOT = Path(__file__).resolve().parents[2]
# What a source checkout holds that the default configuration needs.
SOURCE = ("kvtier", "policies", "connectors", "service", "bench", "pyproject.toml")

PROBE = """
import importlib.metadata as md
try:
    md.distribution("kvtier")
except md.PackageNotFoundError:
    pass
else:
    raise SystemExit("kvtier's package metadata is visible: the test proves nothing")
import kvtier
from kvtier.config import load_config
from kvtier.factory import build_store
cfg = load_config(env={}, overrides=["tiers.0.capacity_bytes=64MiB", "tiers.0.pin=off"])
built = build_store(cfg)
print(kvtier.__file__, type(built.store.placement).__module__, cfg.store.placement)
built.store.close()
"""


def _site_without_kvtier(dst: Path) -> Path:
    """A folder of links to every installed package except kvtier's own metadata."""
    dst.mkdir()
    for entry in sys.path:
        p = Path(entry)
        if p.name != "site-packages" or not p.is_dir():
            continue
        for child in p.iterdir():
            name = child.name
            if name.startswith(("kvtier", "__editable__")) or name.endswith(".pth"):
                continue
            if not (dst / name).exists():
                (dst / name).symlink_to(child)
    return dst


def test_default_config_resolves_from_a_source_tree_without_package_metadata(
    tmp_path: Path,
) -> None:
    src = tmp_path / "checkout"
    src.mkdir()
    ignore = shutil.ignore_patterns("__pycache__", "*.so", "*.egg-info")
    for name in SOURCE:
        if (ROOT / name).is_dir():
            shutil.copytree(ROOT / name, src / name, ignore=ignore)
        else:
            shutil.copy(ROOT / name, src / name)
    site = _site_without_kvtier(tmp_path / "site")
    # -S: no site-packages hooks (.pth files hold the editable install's finder).
    proc = subprocess.run(
        [sys.executable, "-S", "-c", PROBE],
        env={"PYTHONPATH": f"{src}:{site}", "PATH": "/usr/bin:/bin", "HOME": str(tmp_path)},
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    where, placement_module, name = proc.stdout.split()
    assert where == str(src / "kvtier" / "__init__.py")
    assert name == "cost" and placement_module.startswith("kvtier.policies")


def test_builtins_resolve_from_the_table() -> None:
    assert eviction_factory("arc") is ARCEviction
    assert isinstance(placement_factory("keep")(), WriteThrough)
    assert {"lru", "arc", "cost"} <= set(plugins.names(plugins.EVICTION))


def test_the_project_declares_no_entry_points_for_its_own_builtins() -> None:
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    groups = project.get("entry-points", {})
    for group, table in plugins.BUILTIN.items():
        assert not set(groups.get(group, {})) & set(table), group


def test_an_unknown_name_lists_what_exists() -> None:
    with pytest.raises(ConfigError, match=r"store.eviction.*'lru'"):
        eviction_factory("nope")
