"""Real ``redis-server`` processes for tests: one server, or a 3-master Redis Cluster.

The processes come from :mod:`kvtier.bench.redis_procs` (benchmarks start them too); this module adds the skip when
``redis-server`` is missing (``scripts/setup.sh test`` installs it) and the session-wide
server and cluster (:func:`session_server`, :func:`session_cluster`), which start on
first use and are stopped by the session fixture in ``tests/conftest.py``. Fault tests
start their own (``fresh_redis``, ``fresh_cluster``) so that stopping or killing one
never disturbs another test.
"""

from __future__ import annotations

import contextlib
import shutil
import tempfile
from pathlib import Path

import pytest

from kvtier.bench import redis_procs as local
from kvtier.bench.redis_procs import RedisClusterProcs, RedisServer, free_port

__all__ = [
    "RedisClusterProcs",
    "RedisServer",
    "free_port",
    "session_cluster",
    "session_server",
    "stop_session",
]


def require_redis() -> None:
    """Skip the calling test when redis-server is not installed."""
    try:
        local.redis_binaries()
    except FileNotFoundError as exc:
        pytest.skip(str(exc))
    pytest.importorskip("redis", reason="redis-py is not installed: pip install 'kvtier[redis]'")


_SESSION: dict[str, object] = {}
_SESSION_DIR: list[Path] = []


def _session_dir() -> Path:
    if not _SESSION_DIR:
        _SESSION_DIR.append(Path(tempfile.mkdtemp(prefix="kvtier-redis-")))
    return _SESSION_DIR[0]


def session_server() -> RedisServer:
    """The session's shared single server, started on first use."""
    srv = _SESSION.get("single")
    if srv is None:
        require_redis()
        srv = _SESSION["single"] = RedisServer(_session_dir() / "single").start()
    assert isinstance(srv, RedisServer)
    return srv


def session_cluster() -> RedisClusterProcs:
    """The session's shared 3-master cluster, started on first use."""
    c = _SESSION.get("cluster")
    if c is None:
        require_redis()
        c = _SESSION["cluster"] = RedisClusterProcs(_session_dir() / "cluster").start()
    assert isinstance(c, RedisClusterProcs)
    return c


def stop_session() -> None:
    """Stop whatever the session started and remove its files."""
    for name in list(_SESSION):
        obj = _SESSION.pop(name)
        with contextlib.suppress(Exception):
            obj.stop()  # type: ignore[attr-defined]
    for d in _SESSION_DIR:
        shutil.rmtree(d, ignore_errors=True)
    _SESSION_DIR.clear()
