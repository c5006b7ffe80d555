"""Plugins by name: the core's table, the parts a program composes in, entry points for
third parties; the core's defaults resolve with the core alone."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from kvtier import plugins
from kvtier.errors import ConfigError, PluginError
from kvtier.policies import plugins as policy_plugins
from kvtier.policies.eviction import ARCEviction
from kvtier.policies.wiring import placement_for_tiers
from kvtier.store.policy import WriteThrough, eviction_factory, placement_factory

ROOT = Path(__file__).resolve().parents[2]
# A source checkout: the core and the folders an install maps into it.
SOURCE = ("kvtier", "policies", "connectors", "service", "bench", "pyproject.toml")

PROBE = """
import importlib.metadata as md
try:
    md.distribution("kvtier")
except md.PackageNotFoundError:
    pass
else:
    raise SystemExit("kvtier's package metadata is visible: the test proves nothing")
WINGS = ("policies", "connectors", "service", "bench")
import kvtier
from kvtier.config import load_config
from kvtier.factory import build_store
import importlib.util
import sys
cfg = load_config(env={}, overrides=["tiers.0.capacity_bytes=64MiB", "tiers.0.pin=off"])
built = build_store(cfg)
built.store.close()
wings = [m for m in sys.modules if m.partition(".")[2].partition(".")[0] in WINGS]
findable = [w for w in WINGS if importlib.util.find_spec(f"kvtier.{w}") is not None]
print(kvtier.__file__, type(built.store.placement).__module__, cfg.store.placement)
print("loaded:", *wings)
print("findable:", *findable)
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


def test_the_core_alone_runs_its_defaults_from_a_source_tree(tmp_path: Path) -> None:
    """A checkout on PYTHONPATH, with no install and no import hook, is the core alone:
    its default configuration builds a store with the core's own placement, and no wing
    is loaded or even findable (the wings need the install's package-dir mapping)."""
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
    first, loaded, findable = proc.stdout.splitlines()
    where, placement_module, name = first.split()
    assert where == str(src / "kvtier" / "__init__.py")
    assert name == "keep" and placement_module == "kvtier.store.policy"
    assert loaded.split() == ["loaded:"]
    assert findable.split() == ["findable:"]


def test_a_composed_program_defaults_to_the_cost_model() -> None:
    # tests/conftest.py composes the policies in, as the CLI, daemon and connectors do.
    assert plugins.default(plugins.PLACEMENT) == "cost"
    assert placement_factory("cost") is placement_for_tiers
    assert eviction_factory("arc") is ARCEviction


def test_builtins_resolve_from_the_table() -> None:
    assert isinstance(placement_factory("keep")(), WriteThrough)
    assert {"lru", "arc", "cost"} <= set(plugins.names(plugins.EVICTION))


def test_the_core_table_names_no_wing() -> None:
    wings = tuple(f"kvtier.{w}" for w in ("policies", "connectors", "service", "bench", "cli"))
    for group, table in plugins.BUILTIN.items():
        for name, path in table.items():
            assert not path.startswith(wings), (group, name, path)
    assert set(plugins.CORE_DEFAULTS.values()) <= set(plugins.BUILTIN[plugins.PLACEMENT])


def test_composing_again_is_harmless_and_a_conflict_composes_nothing() -> None:
    policy_plugins.compose()
    before = {g: plugins.names(g) for g in plugins.BUILTIN}
    with pytest.raises(PluginError, match="already"):
        plugins.compose(
            {plugins.EVICTION: {"zz-new": "x:y", "arc": "elsewhere:ARC"}},
        )
    with pytest.raises(PluginError, match="core's own"):
        plugins.compose({plugins.PLACEMENT: {"keep": "x:y"}})
    with pytest.raises(PluginError, match="already"):
        plugins.compose({}, {plugins.PLACEMENT: "keep"})
    with pytest.raises(PluginError, match="not a name"):
        plugins.compose({}, {plugins.PLACEMENT: "nope"})
    assert {g: plugins.names(g) for g in plugins.BUILTIN} == before
    assert plugins.default(plugins.PLACEMENT) == "cost"


def test_the_project_declares_no_entry_points_for_its_own_builtins() -> None:
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    groups = project.get("entry-points", {})
    for group in plugins.BUILTIN:
        own = {*plugins.BUILTIN[group], *policy_plugins.NAMES.get(group, {})}
        assert not set(groups.get(group, {})) & own, group


def test_an_unknown_name_lists_what_exists() -> None:
    with pytest.raises(ConfigError, match=r"store.eviction.*'lru'"):
        eviction_factory("nope")


@pytest.mark.parametrize(
    ("imported", "placement"),
    [
        ("kvtier.factory", "keep"),  # the core alone
        ("kvtier.cli.main", "keep"),  # the CLI composes when it runs, not when imported
        ("kvtier.connectors.vllm", "cost"),  # an engine loads it by name
        ("kvtier.connectors.lmcache.settings", "cost"),
        ("kvtier.service.app", "cost"),  # a program embeds create_app
        ("kvtier.bench", "cost"),  # python -m kvtier.bench.NAME
    ],
)
def test_the_parts_that_run_without_the_cli_compose_the_policies_in(
    imported: str, placement: str
) -> None:
    probe = (
        f"import {imported}\n"
        "from kvtier.config import load_config\n"
        "from kvtier.store.policy import eviction_factory\n"
        "cfg = load_config(env={})\n"
        "arc = 'keep' if cfg.store.placement == 'keep' else eviction_factory('arc').__name__\n"
        "print(cfg.store.placement, arc)\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    expected = "keep keep" if placement == "keep" else "cost ARCEviction"
    assert proc.stdout.split() == expected.split()


CLI_PROBE = """
import sys
from typer.testing import CliRunner
from kvtier.cli import main
from kvtier.config import load_config

@main.app.command("probe")
def probe() -> None:
    print(load_config(env={}).store.placement)

if sys.argv[1] == "main":
    sys.argv = ["kvtier", "probe"]
    main.main()  # the console script
else:
    print(CliRunner().invoke(main.app, ["probe"]).output)  # the app alone, as tests call it
"""


@pytest.mark.parametrize("entry", ["main", "app"])
def test_the_cli_composes_before_a_command_runs(entry: str, tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-c", CLI_PROBE, entry],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split() == ["cost"]
