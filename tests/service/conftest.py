"""A real daemon: ``kvtier serve`` in a subprocess on a free loopback port.

The fixture owns the process: it waits for /readyz, and on teardown sends SIGTERM and
checks the daemon shut down cleanly (exit status 0, store closed).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.procs import stop_process

TOKENS = {"alice": "alice-token-0123456789", "bob": "bob-token-0123456789ab"}
SMALL = [
    "--set",
    "service.max_value_bytes=1MiB",
    "--set",
    "tiers.0.capacity_bytes=64MiB",
    "--set",
    "tiers.0.prefault=false",
    "--set",
    "tiers.0.pin=off",  # AUTO imports torch only to find no CUDA: slow start
    "--set",
    "store.io_threads=2",
    "--set",
    "service.data_dir=",  # memory tiers only, unless a test passes --data-dir
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def kvtier_cmd() -> list[str]:
    return [sys.executable, "-m", "kvtier.cli.main"]


@dataclass
class Daemon:
    url: str
    proc: subprocess.Popen[bytes]
    log: Path
    tokens: dict[str, str] = field(default_factory=dict)

    def headers(self, tenant: str | None = None) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.tokens[tenant]}"} if tenant else {}

    def stop(self) -> int:
        return stop_process(self.proc)


def start_daemon(
    tmp: Path,
    *args: str,
    tokens: dict[str, str] | None = None,
    port: int | None = None,
    small: bool = True,
) -> Daemon:
    """``kvtier serve`` on ``port`` (a free one by default), ready; ``small``: with SMALL."""
    port = port or free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVTIER_")}
    for tenant, token in (tokens or {}).items():
        env[f"KVTIER_SERVICE__TOKENS__{tenant.upper()}"] = token
    log = tmp / f"daemon-{port}-{time.monotonic_ns()}.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [*kvtier_cmd(), "serve", "--port", str(port), *(SMALL if small else ()), *args],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
        )
    d = Daemon(f"http://127.0.0.1:{port}", proc, log, dict(tokens or {}))
    return wait_ready(d)


def wait_ready(d: Daemon) -> Daemon:
    """Wait until a started daemon answers /readyz; stop it and raise with its log if not."""
    proc, log = d.proc, d.log
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"daemon exited with {proc.returncode}:\n{log.read_text()}")
        try:
            import httpx

            if httpx.get(f"{d.url}/readyz", timeout=1).status_code == 200:
                return d
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    d.stop()
    raise RuntimeError(f"daemon did not become ready:\n{log.read_text()}")


DaemonFactory = Callable[..., Daemon]


@pytest.fixture(scope="module")
def daemon_factory(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaemonFactory]:
    started: list[Daemon] = []
    tmp = tmp_path_factory.mktemp("daemon")

    def make(
        *args: str,
        tokens: dict[str, str] | None = None,
        port: int | None = None,
        small: bool = True,
    ) -> Daemon:
        d = start_daemon(tmp, *args, tokens=tokens, port=port, small=small)
        started.append(d)
        return d

    yield make
    for d in started:
        rc = d.stop()
        text = d.log.read_text()
        # uvicorn re-raises SIGTERM after its graceful shutdown: -15 is a clean exit.
        assert rc in (0, -signal.SIGTERM), f"daemon exited with {rc}:\n{text}"
        assert "store closed" in text, text


@pytest.fixture(scope="module")
def daemon(daemon_factory: DaemonFactory) -> Daemon:
    """An unauthenticated loopback daemon (values up to 1 MiB, 64 MiB of host tier)."""
    return daemon_factory()


@pytest.fixture(scope="module")
def tenant_daemon(daemon_factory: DaemonFactory) -> Daemon:
    """A daemon with two tenants, alice and bob."""
    return daemon_factory(tokens=TOKENS)
