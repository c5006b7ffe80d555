"""``[[tiers]] kind = "nvme"`` in the config: clear errors, never a traceback from deep inside."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvtier.config import load_config
from kvtier.errors import ConfigError
from kvtier.factory import build_store
from kvtier.tiers.nvme import Durability, EngineKind


def _raw(tmp: Path, **nvme: object) -> dict[str, object]:
    return {
        "model": {"name": "llama-3-8b"},
        "store": {"chunk_tokens": 16},
        "tiers": [
            {"kind": "host", "capacity_bytes": "8MiB", "pin": "off"},
            {"kind": "nvme", "capacity_bytes": "16MiB", **nvme},
        ],
    }


def test_nvme_section_parses_into_typed_options(tmp_path: Path) -> None:
    cfg = load_config(
        base=_raw(
            tmp_path, dir=str(tmp_path), engine="posix", durability="batch", io_piece_bytes="8MiB"
        ),
        env={},
    )
    opts = cfg.tiers[1].options
    assert opts.engine is EngineKind.POSIX and opts.durability is Durability.BATCH
    assert opts.io_piece_bytes == 8 << 20


def test_uring_is_refused_with_the_allowed_engines(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="auto, kvikio, posix"):
        load_config(base=_raw(tmp_path, dir=str(tmp_path), engine="uring"), env={})


def test_unknown_durability_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="sync, batch, none"):
        load_config(base=_raw(tmp_path, dir=str(tmp_path), durability="always"), env={})


def test_missing_directory_is_a_config_error(tmp_path: Path) -> None:
    cfg = load_config(base=_raw(tmp_path, dir=str(tmp_path / "nope"), engine="posix"), env={})
    with pytest.raises(ConfigError, match="existing directory"):
        build_store(cfg, chunk_bytes=64 * 1024)


def test_no_directory_at_all_is_a_config_error(tmp_path: Path) -> None:
    cfg = load_config(base=_raw(tmp_path, engine="posix"), env={})
    with pytest.raises(ConfigError, match="directories"):
        build_store(cfg, chunk_bytes=64 * 1024)


def test_create_dirs_and_several_paths(tmp_path: Path) -> None:
    a, b = tmp_path / "a" / "x", tmp_path / "b"
    cfg = load_config(
        base=_raw(tmp_path, paths=[str(a), str(b)], create_dirs=True, engine="posix"), env={}
    )
    built = build_store(cfg, chunk_bytes=64 * 1024)
    try:
        # One slab per directory, empty until used (slabs grow: test_growth.py).
        assert (a / "nvme.slab0").stat().st_size == 0
        assert (b / "nvme.slab1").stat().st_size == 0
    finally:
        built.store.close()


def test_environment_overrides_the_engine(tmp_path: Path) -> None:
    cfg = load_config(
        base=_raw(tmp_path, dir=str(tmp_path)), env={"KVTIER_TIERS__1__ENGINE": "posix"}
    )
    assert cfg.tiers[1].options.engine is EngineKind.POSIX


def test_second_opener_of_the_same_directory_is_refused(make_store, tmp_path: Path) -> None:
    make_store()
    with pytest.raises(ConfigError, match="no other process"):
        make_store()
