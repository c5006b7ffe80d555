"""The log handler kvtier installs, on a stream that is not a terminal."""

from __future__ import annotations

import io
import json
import logging

import pytest

from kvtier.cli.console import log_handler


def emit(fmt: str, *, exc: bool = False) -> str:
    stream = io.StringIO()
    log = logging.getLogger("kvtier.test_log_format")
    log.propagate = False
    handler = log_handler(fmt, stream)
    log.addHandler(handler)
    try:
        if exc:
            try:
                raise ValueError("bad\nvalue")
            except ValueError:
                log.exception("failed %s", "twice")
        else:
            log.warning("a long warning %s", "x" * 200)
    finally:
        log.removeHandler(handler)
        log.propagate = True
    return stream.getvalue()


def test_text_is_one_line_per_record_however_long() -> None:
    out = emit("text")
    assert out.count("\n") == 1
    assert out.rstrip("\n").endswith("kvtier.test_log_format: a long warning " + "x" * 200)
    assert " WARNING " in out


def test_text_keeps_a_traceback_on_the_record_line() -> None:
    out = emit("text", exc=True)
    assert out.count("\n") == 1, out
    assert "failed twice\\nTraceback (most recent call last):" in out
    assert "ValueError: bad\\nvalue" in out


def test_json_is_one_object_per_line_with_the_exception() -> None:
    out = emit("json", exc=True)
    assert out.count("\n") == 1, out
    rec = json.loads(out)
    assert rec["level"] == "ERROR"
    assert rec["logger"] == "kvtier.test_log_format"
    assert rec["message"] == "failed twice"
    assert rec["exception"].startswith("Traceback (most recent call last):")
    assert rec["exception"].endswith("ValueError: bad\nvalue")
    assert rec["time"].endswith("Z")


def test_json_without_exception_has_the_four_fields() -> None:
    assert json.loads(emit("json")).keys() == {"time", "level", "logger", "message"}


def test_unknown_format_is_refused() -> None:
    with pytest.raises(ValueError, match="xml"):
        log_handler("xml", io.StringIO())


def test_top_level_log_settings_from_the_environment() -> None:
    from kvtier.config import load_config

    cfg = load_config(
        env={"KVTIER_LOG_FORMAT": "json", "KVTIER_LOG_LEVEL": "DEBUG", "KVTIER_TOKEN": "t"}
    )
    assert (cfg.log_format, cfg.log_level) == ("json", "DEBUG")
    assert load_config(env={}).log_format == "text"


def test_unknown_log_format_in_the_environment_is_a_config_error() -> None:
    from kvtier.config import load_config
    from kvtier.errors import ConfigError

    with pytest.raises(ConfigError, match="log_format"):
        load_config(env={"KVTIER_LOG_FORMAT": "xml"})
