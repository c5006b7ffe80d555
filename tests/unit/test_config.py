"""Configuration: precedence, validation messages, the embedded default."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvtier.config import Switch, load_config
from kvtier.errors import ConfigError


def test_default_works_with_nothing_set() -> None:
    cfg = load_config(env={})
    assert cfg.store.chunk_tokens == 256
    assert cfg.tiers[0].kind == "host" and cfg.tiers[0].capacity_bytes > 0


def test_precedence_file_then_env_then_flags(tmp_path: Path) -> None:
    f = tmp_path / "k.toml"
    f.write_text("[store]\nchunk_tokens = 512\nio_threads = 2\n")
    env = {"KVTIER_STORE__CHUNK_TOKENS": "1024", "KVTIER_TIERS__0__CAPACITY_BYTES": "1GiB"}
    cfg = load_config(f, env=env, overrides=["store.chunk_tokens=2048"])
    assert cfg.store.chunk_tokens == 2048
    assert cfg.store.io_threads == 2
    assert cfg.tiers[0].capacity_bytes == 1 << 30


def test_tier_options_are_typed_per_kind() -> None:
    cfg = load_config(
        env={},
        base={
            "tiers": [
                {"kind": "host", "capacity_bytes": "64MiB", "pin": "off"},
                {
                    "kind": "cxl",
                    "name": "far",
                    "capacity_bytes": 1 << 26,
                    "emulate": "on",
                    "latency_us": "0.5",
                },
            ]
        },
    )
    assert cfg.tiers[0].options.pin is Switch.OFF
    assert cfg.tiers[1].name == "far" and cfg.tiers[1].options.latency_us == 0.5


@pytest.mark.parametrize(
    ("overrides", "needle"),
    [
        (["store.chunk_tokens=zero"], "store.chunk_tokens='zero'"),
        (["store.chunk_tokens=0"], "store.chunk_tokens"),
        (["store.bogus=1"], "store.bogus"),
        (["tiers.0.capacity_bytes=lots"], "tiers.0.capacity_bytes"),
        (["tiers.0.kind=floppy"], "tiers.0.kind"),
        (["tiers.0.pin=maybe"], "auto, on, off"),
        (["store.promote_on_hit=perhaps"], "true or false"),
        (["log_level=LOUD"], "log_level"),
        (["nonsense"], "key.path=value"),
    ],
)
def test_bad_values_name_key_value_and_allowed(overrides: list[str], needle: str) -> None:
    with pytest.raises(ConfigError) as exc:
        load_config(env={}, overrides=overrides)
    assert needle in str(exc.value)


def test_bad_file(tmp_path: Path) -> None:
    f = tmp_path / "bad.toml"
    f.write_text("[store\n")
    with pytest.raises(ConfigError, match="valid TOML"):
        load_config(f, env={})
    with pytest.raises(ConfigError, match="readable"):
        load_config(tmp_path / "absent.toml", env={})


def test_kvtier_data_dir_is_service_data_dir() -> None:
    # People type KVTIER_DATA_DIR (issue 12); the nested form and --set still win.
    assert load_config(env={"KVTIER_DATA_DIR": "/srv/kv"}).service.data_dir == "/srv/kv"
    assert load_config(env={"KVTIER_DATA_DIR": ""}).service.data_dir == ""
    both = {"KVTIER_DATA_DIR": "/a", "KVTIER_SERVICE__DATA_DIR": "/b"}
    assert load_config(env=both).service.data_dir == "/b"
    assert load_config(env=both, overrides=["service.data_dir=/c"]).service.data_dir == "/c"


def test_unknown_keys_suggest_the_known_one() -> None:
    with pytest.raises(ConfigError, match=r"did you mean 'capacity_bytes'\?") as err:
        load_config(env={}, overrides=["tiers.0.capacity=4GiB"])
    assert "'kind'" in str(err.value) and "'prefault'" in str(err.value)
    with pytest.raises(ConfigError, match=r"did you mean 'chunk_tokens'\?"):
        load_config(env={}, overrides=["store.chunk_tokns=4"])
