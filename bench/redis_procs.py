"""Local ``redis-server`` processes: one server, or a 3-master Redis Cluster on one machine.

For benchmarks (``kvtier bench redis``, ``kvtier bench daemon``) and the test suite
(``tests/redis_servers.py``); nothing in the core uses them. Servers listen on free
loopback ports without persistence (no RDB, no AOF), with their files under a given
directory, and allow ``DEBUG`` from localhost (fault tests use ``DEBUG SLEEP``). Not
for production use.
"""

from __future__ import annotations

import random
import shutil
import socket
import subprocess
import time
from pathlib import Path
from typing import Any

START_TIMEOUT_S = 20.0


def redis_binaries() -> tuple[str, str]:
    """Paths of redis-server and redis-cli.

    Raises:
        FileNotFoundError: not installed (``scripts/setup.sh test`` installs them).
    """
    server = shutil.which("redis-server") or shutil.which("redis-server", path="/usr/sbin:/usr/bin")
    cli = shutil.which("redis-cli") or shutil.which("redis-cli", path="/usr/sbin:/usr/bin")
    if not server or not cli:
        raise FileNotFoundError("redis-server/redis-cli not installed (scripts/setup.sh test)")
    return server, cli


def _port_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port() -> int:
    """A free loopback port whose cluster-bus twin (port + 10000) is free too."""
    rng = random.Random()
    for _ in range(200):
        port = rng.randrange(20000, 30000)
        if _port_free(port) and _port_free(port + 10000):
            return port
    raise RuntimeError("no free loopback port pair found")


class RedisServer:
    """One redis-server process on 127.0.0.1. Not thread-safe; tests drive it."""

    def __init__(
        self, workdir: Path, *, port: int | None = None, args: tuple[str, ...] = ()
    ) -> None:
        self.server_bin, self.cli_bin = redis_binaries()
        self.port = port or free_port()
        self.workdir = workdir
        self.args = args
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def client(self) -> Any:
        """A plain redis-py client (for tests and benchmarks)."""
        import redis

        return redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=10)

    def start(self) -> RedisServer:
        import redis  # noqa: F401 - the readiness check needs redis-py: say so now, not in 20 s

        self.workdir.mkdir(parents=True, exist_ok=True)
        cmd = [
            self.server_bin,
            "--port",
            str(self.port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
            "--dir",
            str(self.workdir),
            "--protected-mode",
            "no",
            "--enable-debug-command",
            "local",
            "--logfile",
            str(self.workdir / f"redis-{self.port}.log"),
            *self.args,
        ]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            if self.proc.poll() is not None:
                rc = self.proc.returncode
                raise RuntimeError(f"redis-server exited with {rc}: {self.log_tail()}")
            try:
                if self.client().ping():
                    return self
            except Exception:  # not up yet
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"redis-server on {self.port} did not start: {self.log_tail()}")
            time.sleep(0.05)

    def log_tail(self) -> str:
        log = self.workdir / f"redis-{self.port}.log"
        return log.read_text()[-2000:] if log.exists() else ""

    def stop(self) -> None:
        """Stop the server (SIGTERM, then SIGKILL) and wait for it. Idempotent."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self.proc = None

    def kill(self) -> None:
        """SIGKILL, as a crash would."""
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait(10)
            self.proc = None


class RedisClusterProcs:
    """Three redis-server masters joined by ``redis-cli --cluster create``."""

    def __init__(self, workdir: Path, masters: int = 3) -> None:
        self.servers = [
            RedisServer(
                workdir / f"node{i}",
                args=(
                    "--cluster-enabled",
                    "yes",
                    "--cluster-config-file",
                    "nodes.conf",
                    "--cluster-node-timeout",
                    "5000",  # a loaded small machine can stall for seconds
                    # Live masters keep serving their slots while another is down.
                    "--cluster-require-full-coverage",
                    "no",
                ),
            )
            for i in range(masters)
        ]

    @property
    def seeds(self) -> tuple[str, ...]:
        return tuple(s.address for s in self.servers)

    def start(self) -> RedisClusterProcs:
        try:
            for s in self.servers:
                s.start()
            cli = self.servers[0].cli_bin
            subprocess.run(
                [
                    cli,
                    "--cluster",
                    "create",
                    *self.seeds,
                    "--cluster-replicas",
                    "0",
                    "--cluster-yes",
                ],
                check=True,
                capture_output=True,
                timeout=60,
            )
            deadline = time.monotonic() + START_TIMEOUT_S
            while not all(self._state_ok(s) for s in self.servers):
                if time.monotonic() > deadline:
                    raise RuntimeError("redis cluster did not reach cluster_state:ok")
                time.sleep(0.1)
        except BaseException:
            self.stop()
            raise
        return self

    @staticmethod
    def _state_ok(s: RedisServer) -> bool:
        try:
            info = s.client().execute_command("CLUSTER", "INFO")
        except Exception:
            return False
        text = info.decode() if isinstance(info, bytes) else str(info)
        return "cluster_state:ok" in text

    def owner_of(self, redis_key: bytes) -> RedisServer:
        """The master that holds ``redis_key``'s hash slot (asked of a live node)."""
        from redis.crc import key_slot

        slot = key_slot(redis_key)
        live = next(x for x in self.servers if x.proc is not None)
        for lo, hi, primary, *_replicas in live.client().execute_command("CLUSTER", "SLOTS"):
            if lo <= slot <= hi:
                return next(x for x in self.servers if x.port == int(primary[1]))
        raise LookupError(f"slot {slot} is not covered")

    def stop(self) -> None:
        for s in self.servers:
            s.stop()
