"""Session-wide fixtures: real Redis servers (see tests/redis_servers.py)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvtier.policies import compose
from tests import redis_servers

# The tests run kvtier as its programs do: with the policies composed in beside the core
# (placement "cost" by default). tests/unit/test_plugins.py runs the core alone.
compose()

# LMCache's tests run in a process of their own (tests/connectors/test_lmcache_isolated.py):
# importing lmcache pulls in numba/llvmlite, whose objects break vLLM 0.32's triton
# dispatcher scan of sys.modules when an in-process engine starts later in the session.
collect_ignore = [] if os.environ.get("KVTIER_LMCACHE_TESTS") else ["lmcache"]


def _tree_state(root: Path) -> tuple[tuple[str, int, int], ...] | None:
    """Every path under ``root`` with its size and mtime, or None when it does not exist."""
    if not root.exists():
        return None
    paths = [root, *sorted(root.rglob("*"))]
    return tuple((str(p), p.lstat().st_size, p.lstat().st_mtime_ns) for p in paths)


@pytest.fixture(scope="session", autouse=True)
def _user_data_dir_untouched() -> Iterator[None]:
    """Fails the session when any test wrote to the user's default data directory.

    Tests (and the daemons, engines and CLI runs they start) must use temporary
    directories; a test that started a daemon with its own config and no ``data_dir``
    once created ``~/.local/share/kvtier`` on the developer's machine.
    """
    root = Path("~/.local/share/kvtier").expanduser()
    before = _tree_state(root)
    yield
    after = _tree_state(root)
    if after != before:
        changed = sorted({e[0] for e in (after or ())} ^ {e[0] for e in (before or ())})
        pytest.fail(
            f"the test session changed the user's data directory {root} "
            f"(paths added or removed: {changed[:10] or 'none; contents modified'}): "
            "give every daemon, engine and CLI run a temporary data_dir",
            pytrace=False,
        )


@pytest.fixture(scope="session", autouse=True)
def _redis_session_teardown() -> Iterator[None]:
    """Owns the teardown of the lazily started session server and cluster.

    Starts nothing itself: a server starts only when a test (or a contract factory)
    first asks for it.
    """
    yield
    redis_servers.stop_session()


@pytest.fixture(scope="session")
def redis_server() -> redis_servers.RedisServer:
    """A redis-server shared by the session's tests; isolate with a unique key prefix."""
    return redis_servers.session_server()


@pytest.fixture(scope="session")
def redis_cluster() -> redis_servers.RedisClusterProcs:
    """A 3-master Redis Cluster shared by the session's tests."""
    return redis_servers.session_cluster()


@pytest.fixture
def fresh_redis(tmp_path: Path) -> Iterator[redis_servers.RedisServer]:
    """A redis-server of this test's own, for tests that stop, restart or fill it."""
    redis_servers.require_redis()
    srv = redis_servers.RedisServer(tmp_path / "redis").start()
    yield srv
    srv.stop()


@pytest.fixture
def fresh_cluster(tmp_path: Path) -> Iterator[redis_servers.RedisClusterProcs]:
    """A 3-master cluster of this test's own, for tests that kill a master."""
    redis_servers.require_redis()
    c = redis_servers.RedisClusterProcs(tmp_path / "cluster").start()
    yield c
    c.stop()
