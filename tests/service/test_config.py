"""The [service] section: defaults, validation, and secrets kept out of reprs."""

from __future__ import annotations

import pytest

from kvtier.config import is_loopback, load_config
from kvtier.errors import ConfigError

TOKEN = "t" * 20


def test_defaults_bind_loopback_without_tokens() -> None:
    s = load_config(env={}).service
    assert s.host == "127.0.0.1"
    assert dict(s.tokens) == {}


@pytest.mark.parametrize(
    ("host", "loop"),
    [
        ("127.0.0.1", True),
        ("127.9.9.9", True),
        ("::1", True),
        ("localhost", True),
        ("0.0.0.0", False),
        ("::", False),
        ("10.0.0.1", False),
        ("example.com", False),
    ],
)
def test_loopback_detection(host: str, loop: bool) -> None:
    assert is_loopback(host) is loop


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "192.168.1.5"])
def test_non_loopback_needs_a_token(host: str) -> None:
    with pytest.raises(ConfigError, match=r"service\.tokens"):
        load_config(env={}, overrides=[f"service.host={host}"])
    cfg = load_config(env={"KVTIER_SERVICE__TOKENS__A": TOKEN}, overrides=[f"service.host={host}"])
    assert dict(cfg.service.tokens) == {"a": TOKEN}


@pytest.mark.parametrize(
    ("env", "key"),
    [
        ({"KVTIER_SERVICE__TOKENS__A": "short"}, "service.tokens.a"),
        (
            {"KVTIER_SERVICE__TOKENS__A": TOKEN, "KVTIER_SERVICE__TOKENS__B": TOKEN},
            "service.tokens",
        ),
        ({"KVTIER_SERVICE__TOKENS__BAD!NAME": TOKEN}, "service.tokens.bad!name"),
        ({"KVTIER_SERVICE__PORT": "70000"}, "service.port"),
        ({"KVTIER_SERVICE__MAX_BATCH_KEYS": "0"}, "service.max_batch_keys"),
        ({"KVTIER_SERVICE__MAX_BODY_BYTES": "1KiB"}, "service.max_body_bytes"),
    ],
)
def test_bad_service_settings_fail_naming_the_key(env: dict[str, str], key: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(env=env)
    assert info.value.key == key
    assert "short" not in str(info.value) and TOKEN not in str(info.value)


def test_tokens_and_salt_stay_out_of_the_repr() -> None:
    cfg = load_config(
        env={"KVTIER_SERVICE__TOKENS__A": TOKEN, "KVTIER_SERVICE__KEY_SALT": "pepper"}
    )
    assert TOKEN not in repr(cfg) and "pepper" not in repr(cfg)
    assert cfg.service.key_salt == "pepper"
