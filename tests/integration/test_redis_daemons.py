"""Two kvtier daemons, each with its own host tier, over one Redis: two machines in small.

Each daemon is a real ``kvtier serve`` process (uvicorn) with a host tier of two chunks
above a redis tier; both share the key salt, so a client key maps to the same internal key
in both. Chunks put through daemon A are demoted from its host tier into Redis as more
arrive; daemon B, which never saw them, finds them there and serves the same bytes.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest

from tests.procs import stop_process
from tests.redis_servers import RedisServer, free_port

pytestmark = pytest.mark.redis
httpx = pytest.importorskip("httpx")

CHUNK = 256 * 1024


def write_config(path: Path, redis_url: str, prefix: str) -> Path:
    path.write_text(f"""
[store]
io_threads = 2
# Sharing is under test, not placement: demote every victim down to Redis.
placement = "keep"

[service]
key_salt = "one-secret-for-every-daemon-of-this-cache"
data_dir = ""
max_value_bytes = {CHUNK}

[[tiers]]
kind = "host"
capacity_bytes = {2 * CHUNK}
pin = "off"
prefault = false

[[tiers]]
kind = "redis"
capacity_bytes = "1GiB"
url = "{redis_url}"
key_prefix = "{prefix}"
""")
    return path


class Daemon:
    """One ``kvtier serve`` process; :meth:`stop` ends it with SIGTERM (graceful)."""

    def __init__(self, config: Path, log: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log
        env = {k: v for k, v in os.environ.items() if not k.startswith("KVTIER_")}
        with log.open("wb") as out:
            self.proc = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "kvtier.cli.main",
                    "serve",
                    "--config",
                    str(config),
                    "--port",
                    str(self.port),
                ],
                stdout=out,
                stderr=subprocess.STDOUT,
                env=env,
            )
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"daemon exited {self.proc.returncode}:\n{log.read_text()}")
            try:
                if httpx.get(f"{self.url}/readyz", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"daemon did not become ready:\n{log.read_text()}")

    def stop(self) -> int:
        return stop_process(self.proc)


@contextmanager
def daemon_pair(tmp_path: Path, config_a: Path, config_b: Path) -> Iterator[tuple[Daemon, Daemon]]:
    """Daemons a and b on their configs; both stopped at the end, each exit checked clean."""
    started: list[Daemon] = []
    try:
        for name, cfg in (("a", config_a), ("b", config_b)):
            started.append(Daemon(cfg, tmp_path / f"daemon-{name}.log"))
        yield started[0], started[1]
    finally:
        for d in started:
            rc = d.stop()
            # uvicorn re-raises SIGTERM after its graceful shutdown: -15 is a clean exit.
            assert rc in (0, -signal.SIGTERM), d.log.read_text()


@pytest.fixture
def two_daemons(tmp_path: Path, redis_server: RedisServer) -> Iterator[tuple[Daemon, Daemon]]:
    cfg = write_config(tmp_path / "kvtier.toml", redis_server.url, f"d-{uuid.uuid4().hex[:8]}")
    with daemon_pair(tmp_path, cfg, cfg) as pair:
        yield pair


def test_chunk_put_through_one_daemon_is_a_hit_through_the_other(two_daemons) -> None:
    from kvtier.service.client import Client

    a, b = two_daemons
    rng = np.random.default_rng(11)
    keys = [rng.bytes(16).hex() for _ in range(8)]
    values = [rng.bytes(CHUNK) for _ in keys]
    with Client(a.url) as ca, Client(b.url) as cb:
        for k, v in zip(keys, values, strict=True):
            assert ca.put(k, v).stored == 1  # one at a time: older ones go down to Redis
        where_a = ca.lookup(keys)
        assert where_a.hits == 8 and set(where_a.tiers) == {"host", "redis"}
        assert cb.lookup(keys[:1]).hits == 1  # not the other's host tier: Redis
        found = cb.lookup(keys)
        assert found.hits >= 6 and set(found.tiers) == {"redis"}
        for k, v in zip(keys[: found.hits], values, strict=False):
            assert cb.get(k) == v  # byte for byte
        # And the other way round: B stores, A reads what B's host tier pushed down.
        more = [rng.bytes(16).hex() for _ in range(4)]
        more_values = [rng.bytes(CHUNK) for _ in more]
        for k, v in zip(more, more_values, strict=True):
            cb.put(k, v)
        assert ca.get(more[0]) == more_values[0]
