"""docs/configuration.md and docs/operations.md against the code (issue 12: both stated
defaults that were not the real ones).

Every row of the defaults tables in docs/configuration.md is checked against the
effective default: ``kvtier/default.toml`` over the config dataclasses for the sections,
and each tier kind's options class for the tier tables. A key in the code but missing
from its table fails too. docs/operations.md's statements about the defaults and its
sample ``[service]`` TOML are checked against the same values.
"""

from __future__ import annotations

import dataclasses
import enum
import re
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest

from kvtier.config import KVTierConfig, load_config
from kvtier.tiers.registry import tier_options_class
from kvtier.units import GiB, parse_size

ROOT = Path(__file__).resolve().parents[2]
CONFIG_MD = (ROOT / "docs" / "configuration.md").read_text()
OPERATIONS_MD = (ROOT / "docs" / "operations.md").read_text()
DEFAULT = load_config(env={})

# Heading of a table in docs/configuration.md -> (where the defaults come from, keys the
# table does not list on purpose).
SECTIONS: dict[str, tuple[Any, set[str]]] = {
    # The top-level table lists plain keys; each section has its own table below.
    "## Top level": (
        DEFAULT,
        {
            f.name
            for f in dataclasses.fields(KVTierConfig)
            if dataclasses.is_dataclass(getattr(DEFAULT, f.name))
        }
        | {"tiers"},
    ),
    "## `[model]`": (DEFAULT.model, set()),
    "## `[store]`": (DEFAULT.store, set()),
    "## `[service]`": (DEFAULT.service, set()),
    "## `[placement]`": (DEFAULT.placement, set()),
    "## `[tenants]`": (DEFAULT.tenants, set()),
    "## `[encryption]`": (DEFAULT.encryption, set()),
    '### `kind = "host"`': ("host", set()),
    '### `kind = "cxl"`': ("cxl", set()),
    '### `kind = "gpu"`': ("gpu", set()),
    "## nvme": ("nvme", set()),
    "## redis": ("redis", set()),
    '## meta tier (`kind = "meta"`)': ("meta", set()),
}
try:  # the transfer package needs torch, an optional dependency
    from kvtier.transfer import TransferOptions
except ImportError:
    pass
else:
    SECTIONS["## Transfer engine (`kvtier.transfer.TransferOptions`)"] = (TransferOptions(), set())


def table_rows(heading: str) -> dict[str, str]:
    """key -> default cell of the first table after ``heading``."""
    start = CONFIG_MD.index(heading + "\n")
    nxt = re.search(r"^#{2,3} ", CONFIG_MD[start + len(heading) + 1 :], re.M)
    section = CONFIG_MD[start : start + len(heading) + 1 + (nxt.start() if nxt else len(CONFIG_MD))]
    rows: dict[str, str] = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) < 3 or not cells[0].startswith("`"):
            continue
        keys = re.findall(r"`(?:transfer\.)?([a-z_0-9]+)`", cells[0])
        values = [v.strip() for v in cells[1].split(",")] if len(keys) > 1 else [cells[1]]
        for k, v in zip(keys, values, strict=True):
            rows[k] = v
    return rows


def defaults_of(source: Any) -> dict[str, Any]:
    if isinstance(source, str):  # a tier kind: its options class's field defaults
        cls = tier_options_class(source)
        out = {}
        for f in dataclasses.fields(cls):
            if f.default is not dataclasses.MISSING:
                out[f.name] = f.default
            elif f.default_factory is not dataclasses.MISSING:
                out[f.name] = f.default_factory()
        return out
    return {f.name: getattr(source, f.name) for f in dataclasses.fields(source)}


def normal(value: Any) -> Any:
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, Mapping):
        return dict(value)
    if isinstance(value, tuple):
        return list(value)
    return value


def parse_cell(cell: str, key: str) -> Any:
    v = cell.strip().strip("`").strip()
    if v == "unset":
        return None
    if key.endswith("_bytes"):
        return parse_size(v.strip('"'))
    try:
        return tomllib.loads(f"v = {v}")["v"]
    except tomllib.TOMLDecodeError:
        return v  # an unquoted string (a URL, a prefix)


@pytest.mark.parametrize("heading", sorted(SECTIONS))
def test_configuration_md_defaults_are_the_real_ones(heading: str) -> None:
    source, unlisted = SECTIONS[heading]
    rows = table_rows(heading)
    real = {k: normal(v) for k, v in defaults_of(source).items() if k not in unlisted}
    missing = sorted(set(real) - set(rows))
    assert not missing, f"{heading}: keys without a row: {missing}"
    wrong = {k: (rows[k], real[k]) for k in real if normal(parse_cell(rows[k], k)) != real[k]}
    assert not wrong, f"{heading}: documented vs real default: {wrong}"


def test_the_default_store_is_what_operations_md_says() -> None:
    host = DEFAULT.tiers[0]
    assert host.kind == "host" and len(DEFAULT.tiers) == 1
    s = DEFAULT.service
    said = re.search(
        r"default configuration: a (\d+) GiB host tier\s+and an (\d+) GiB nvme tier "
        r"under `([^`]+)/nvme`",
        OPERATIONS_MD,
    )
    assert said, "docs/operations.md no longer states the default tiers"
    assert int(said.group(1)) * GiB == host.capacity_bytes
    assert int(said.group(2)) * GiB == s.data_capacity_bytes
    assert said.group(3) == s.data_dir
    assert f"default `{s.data_dir}`" in OPERATIONS_MD
    assert f"(default {s.data_capacity_bytes // GiB} GiB" in OPERATIONS_MD


def test_operations_md_sample_service_toml_loads_and_shows_the_defaults() -> None:
    m = re.search(r"```toml\n(\[service\].*?)```", OPERATIONS_MD, re.S)
    assert m
    sample = tomllib.loads(m.group(1))
    cfg = load_config(env={}, base=_with(sample))
    for key, value in sample["service"].items():
        if key == "tokens":
            continue
        assert normal(getattr(cfg.service, key)) == normal(getattr(DEFAULT.service, key)), (
            f"operations.md's sample sets service.{key} = {value!r}, not the default"
        )


def _with(sample: dict[str, Any]) -> dict[str, Any]:
    from kvtier.config import default_toml, merge

    return merge(default_toml(), sample)


def test_every_top_level_section_has_a_table() -> None:
    # the sections; plain top-level keys (log_level, log_format) are rows of "## Top level"
    names = {
        f.name
        for f in dataclasses.fields(KVTierConfig)
        if dataclasses.is_dataclass(getattr(DEFAULT, f.name))
    }
    for name in names:
        assert f"## `[{name}]`" in CONFIG_MD, name


def _row(text: str, command: str) -> str:
    """The line of a table whose first cell names ``command`` (in backticks)."""
    rows = [
        line
        for line in text.splitlines()
        if line.startswith("| ") and f"`{command}`" in line.split("|")[1]
    ]
    assert len(rows) == 1, f"one table row for {command}, found {len(rows)}"
    return rows[0]


def test_the_host_tier_sizes_in_the_readme_and_operations_md_are_the_real_ones() -> None:
    from kvtier.cli.demo import DEMO_HOST_BYTES

    readme = (ROOT / "README.md").read_text()
    serve_gib = DEFAULT.tiers[0].capacity_bytes // GiB
    demo_gib = min(DEFAULT.tiers[0].capacity_bytes, DEMO_HOST_BYTES) // GiB
    assert f"the {serve_gib} GiB host tier" in _row(readme, "kvtier serve")
    assert f"a {demo_gib} GiB host tier" in _row(readme, "kvtier demo")
    assert f"the host tier ({serve_gib} GiB by default)" in _row(OPERATIONS_MD, "kvtier serve")
    assert f"a {demo_gib} GiB host tier" in _row(OPERATIONS_MD, "kvtier demo")
    for doc in (readme, OPERATIONS_MD):  # and no other host tier size in the demo's rows
        sizes = re.findall(r"(\d+(?:\.\d+)?) GiB host tier", _row(doc, "kvtier demo"))
        assert {float(n) for n in sizes} == {demo_gib}, sizes
