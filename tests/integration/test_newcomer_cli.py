"""What a newcomer meets first (issue 12): start-up, the data directory, errors, help, pipes.

Real processes throughout: ``kvtier serve`` on a free port (or a port another real process
holds), the CLI's stdout through a pipe.
"""

from __future__ import annotations

import pytest

pytest.importorskip("fastapi", reason="needs the service extra: pip install 'kvtier[service]'")
pytest.importorskip("uvicorn", reason="needs the service extra: pip install 'kvtier[service]'")
pytest.importorskip("httpx", reason="needs the service extra: pip install 'kvtier[service]'")

import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

KVTIER = [sys.executable, "-m", "kvtier.cli.main"]
# Small tiers, no CUDA probe: a daemon that starts in seconds and takes 64 MiB of disk.
SMALL_ENV = {
    "KVTIER_TIERS__0__CAPACITY_BYTES": "64MiB",
    "KVTIER_TIERS__0__PIN": "off",
    "KVTIER_SERVICE__DATA_CAPACITY_BYTES": "64MiB",
}


def clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVTIER_")}
    env.update(SMALL_ENV)
    env.update(extra)
    return env


def run(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*KVTIER, *args],
        capture_output=True,
        text=True,
        timeout=600,
        env=env or clean_env(),
        check=False,
    )


def test_a_busy_port_is_one_line_and_exit_2_before_anything_is_allocated(tmp_path: Path) -> None:
    data = tmp_path / "data"
    with socket.socket() as holder:  # a real process (this one) listens on the port
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        res = run("serve", "--port", str(port), env=clean_env(KVTIER_DATA_DIR=str(data)))
    assert res.returncode == 2, res.stdout + res.stderr
    lines = [ln for ln in (res.stdout + res.stderr).splitlines() if ln.strip()]
    assert len(lines) == 1, lines
    assert f"127.0.0.1:{port} is in use" in lines[0] and "--port" in lines[0]
    assert not data.exists()  # bound first: no store, no preallocated slab


def start(tmp_path: Path, *args: str, **env: str) -> tuple[subprocess.Popen[str], list[str], str]:
    """Start ``kvtier serve --port 0``; returns the process, its log up to 'ready', the URL."""
    proc = subprocess.Popen(
        [*KVTIER, "serve", "--port", "0", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=clean_env(**env),
    )
    assert proc.stdout is not None
    lines: list[str] = []
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        lines.append(line)
        if "kvtier daemon ready" in line:
            text = "".join(lines)
            m = re.search(r"bound to (http://127\.0\.0\.1:\d+)", text)
            assert m, text
            return proc, lines, m.group(1)
    proc.kill()
    raise AssertionError("no ready line:\n" + "".join(lines))


@pytest.mark.parametrize(("how", "sig"), [("env", signal.SIGTERM), ("flag", signal.SIGINT)])
def test_serve_binds_then_says_ready_and_a_signal_stops_it_quietly(
    tmp_path: Path, how: str, sig: signal.Signals
) -> None:
    data = tmp_path / "data"
    if how == "env":
        proc, lines, url = start(tmp_path, KVTIER_DATA_DIR=str(data))
    else:
        proc, lines, url = start(tmp_path, "--data-dir", str(data))
    try:
        text = "".join(lines)
        assert text.index("bound to") < text.index("kvtier daemon ready")
        # Ready means ready: the first request after the line is served, no retry.
        assert httpx.get(f"{url}/readyz", timeout=10).status_code == 200
        assert (data / "nvme").is_dir() and (data / "key_salt").is_file()
    finally:
        proc.send_signal(sig)
        out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0, out
    assert "Traceback" not in out and "kvtier daemon: store closed" in out


def one_error_line(res: subprocess.CompletedProcess[str]) -> str:
    assert res.returncode == 2, res.stdout + res.stderr
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), res.stderr
    assert "Traceback" not in res.stdout + res.stderr
    return lines[0]


def test_errors_name_the_fix_in_one_line(tmp_path: Path) -> None:
    env = clean_env(KVTIER_DATA_DIR=str(tmp_path / "data"), COLUMNS="60")  # narrow: no wrapping
    line = one_error_line(run("demo", "--set", "tiers.0.capacity=4GiB", env=env))
    assert "did you mean 'capacity_bytes'" in line and "'capacity_bytes'" in line
    line = one_error_line(run("demo", "--set", "model.name=llama-4", env=env))
    assert "neither a preset" in line and "llama-3-8b" in line and "qwen2-7b" in line
    line = one_error_line(run("demo", "--trace", str(tmp_path / "absent.jsonl"), env=env))
    assert "absent.jsonl" in line and "mooncake-conversation" in line
    line = one_error_line(run("calc", "--trace", "mooncake-nosuch", env=env))
    assert "mooncake-nosuch" in line and "mooncake-synthetic" in line
    assert not (tmp_path / "data").exists()  # every one failed before allocating


@pytest.mark.parametrize(
    "cmd", [[], ["serve"], ["demo"], ["info"], ["bench"], ["calc"], ["calc", "sweep"]]
)
def test_help_has_no_stray_type_labels(cmd: list[str]) -> None:
    res = run(*cmd, "--help")
    assert res.returncode == 0, res.stderr
    assert "<bool>" not in res.stdout and "Show this message and exit" in res.stdout


def test_tables_keep_their_columns_when_piped(tmp_path: Path) -> None:
    # stdout is a pipe here, as in `kvtier calc ... | less`.
    res = run(
        "calc",
        "--synthetic-requests",
        "150",
        "--capacity",
        "host=200GB",
        "--capacity",
        "nvme=2TB",
        env=clean_env(),
    )
    assert res.returncode == 0, res.stderr
    assert "…" not in res.stdout
    for header in ("capacity", "writes/day", "wear %/yr (rated)", "seed $/GB-mo", "CXL bandwidth"):
        assert header in res.stdout, header
