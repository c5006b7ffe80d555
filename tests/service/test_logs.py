"""The daemon's log on a pipe, as a log collector reads it: one record per line, kvtier's
and uvicorn's records in one format, and ``log_format = "json"`` one object per line."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import httpx

from tests.service.conftest import SMALL, free_port, kvtier_cmd

LINE = re.compile(
    r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z (DEBUG|INFO|WARNING|ERROR|CRITICAL) [\w.]+: \S"
)


def run_daemon(tmp_path: Path, *args: str, env: dict[str, str] | None = None) -> str:
    """Start ``kvtier serve`` with stderr on a pipe, serve one request, stop it; its stderr."""
    port = free_port()
    base = {k: v for k, v in os.environ.items() if not k.startswith("KVTIER_")}
    proc = subprocess.Popen(
        [*kvtier_cmd(), "serve", "--port", str(port), *SMALL, *args],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        env={**base, **(env or {})},
        cwd=tmp_path,
    )
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/readyz", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.2)
        assert proc.poll() is None, "the daemon exited before it was ready"
        httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=5)
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    return err.decode()


def test_text_log_on_a_pipe_is_one_line_per_record(tmp_path: Path) -> None:
    err = run_daemon(tmp_path)
    lines = err.splitlines()
    assert lines, "the daemon wrote no log"
    for line in lines:
        assert LINE.match(line), f"not one record per line:\n{err}"
    loggers = {line.split(" ", 3)[2].rstrip(":") for line in lines}
    # kvtier's and uvicorn's records in the same format, side by side
    assert any(name.startswith("kvtier.") for name in loggers), err
    assert any(name.startswith("uvicorn") for name in loggers), err
    # the longest records are whole on their line, never wrapped at 80 columns
    bound = [line for line in lines if "kvtier daemon bound to http://127.0.0.1:" in line]
    assert len(bound) == 1 and bound[0].endswith("; opening the store"), err
    assert any(len(line) > 100 for line in lines), err
    assert any(line.endswith("kvtier daemon: store closed") for line in lines), err


def test_json_log_is_one_object_per_line(tmp_path: Path) -> None:
    err = run_daemon(tmp_path, env={"KVTIER_LOG_FORMAT": "json"})
    records = [json.loads(line) for line in err.splitlines()]
    assert records, "the daemon wrote no log"
    for rec in records:
        assert {"time", "level", "logger", "message"} <= rec.keys(), rec
        assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z", rec["time"]), rec
    loggers = {rec["logger"] for rec in records}
    assert any(name.startswith("kvtier.") for name in loggers), loggers
    assert any(name.startswith("uvicorn") for name in loggers), loggers
    assert any(rec["message"] == "kvtier daemon: store closed" for rec in records), records


def test_log_format_from_the_config_file(tmp_path: Path) -> None:
    cfg = tmp_path / "kvtier.toml"
    cfg.write_text('log_format = "json"\n')
    err = run_daemon(tmp_path, "--config", str(cfg))
    assert [json.loads(line)["logger"] for line in err.splitlines()], err


def test_unknown_log_format_is_refused_at_start(tmp_path: Path) -> None:
    out = subprocess.run(
        [*kvtier_cmd(), "serve", "--port", str(free_port()), *SMALL, "--set", "log_format=xml"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=tmp_path,
    )
    assert out.returncode != 0
    assert "log_format" in out.stderr and "json" in out.stderr, out.stderr
