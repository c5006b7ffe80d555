"""Per-tenant quotas against real daemons: a tenant that writes far past its quota
evicts only its own chunks, and racing puts never take it past the quota."""

from __future__ import annotations

import pytest

pytest.importorskip("fastapi", reason="needs the service extra: pip install 'kvtier[service]'")
pytest.importorskip("httpx", reason="needs the service extra: pip install 'kvtier[service]'")

import os
import statistics
import time
from concurrent.futures import ThreadPoolExecutor

import httpx

from .conftest import TOKENS, DaemonFactory

VALUE = 1 << 20  # one slot (service.max_value_bytes): 64 in the host tier
QUOTA = 8 << 20  # alice's host quota: 8 slots
QUOTA_ARGS = (
    "--set",
    f"tenants.quotas.alice.host={QUOTA}",
    "--set",
    "tenants.default_quota.host=48MiB",  # bob's, as a tenant not named
)


def _keys(n: int) -> list[str]:
    return [os.urandom(16).hex() for _ in range(n)]


def _hits(c: httpx.Client, keys: list[str]) -> int:
    return sum(c.head(f"/v1/chunks/{k}").status_code == 200 for k in keys)


def _flood(daemon_factory: DaemonFactory, *args: str) -> tuple[int, int, list[float], list[float]]:
    """Bob stores a working set, alice writes 10x her quota; returns bob's hits before
    and after, and alice's put latencies under her quota and past it."""
    d = daemon_factory(*args, tokens=TOKENS)
    value = os.urandom(VALUE)
    with (
        httpx.Client(base_url=d.url, headers=d.headers("alice")) as alice,
        httpx.Client(base_url=d.url, headers=d.headers("bob")) as bob,
    ):
        working = _keys(40)  # 40 MiB
        for k in working:
            assert bob.put(f"/v1/chunks/{k}", content=value).json()["stored"] == 1
        before = _hits(bob, working)
        lat: list[float] = []
        for k in _keys(10 * QUOTA // VALUE):
            t0 = time.perf_counter()
            r = alice.put(f"/v1/chunks/{k}", content=value)
            lat.append(time.perf_counter() - t0)
            assert r.status_code == 200, r.text
        after = _hits(bob, working)
    n = QUOTA // VALUE
    return before, after, lat[:n], lat[n:]


def test_a_tenant_ten_times_over_its_quota_leaves_another_tenants_set_resident(
    daemon_factory: DaemonFactory,
) -> None:
    before, after, under, over = _flood(daemon_factory, *QUOTA_ARGS)
    assert before == after == 40
    ratio = statistics.median(over) / statistics.median(under)
    print(f"alice put latency, past her quota / within it (median): {ratio:.2f}")


def test_without_quotas_the_same_flood_evicts_the_other_tenant(
    daemon_factory: DaemonFactory,
) -> None:
    # The control: the test above would fail if quotas did nothing.
    before, after, _, _ = _flood(daemon_factory)
    assert before == 40
    assert after < 40


def test_racing_puts_never_take_a_tenant_past_its_quota(daemon_factory: DaemonFactory) -> None:
    d = daemon_factory(*QUOTA_ARGS, tokens=TOKENS)
    value = os.urandom(VALUE)
    keys = _keys(4 * QUOTA // VALUE)

    def put(k: str) -> int:
        with httpx.Client(base_url=d.url, headers=d.headers("alice")) as c:
            return c.put(f"/v1/chunks/{k}", content=value).status_code

    with ThreadPoolExecutor(16) as pool:
        assert set(pool.map(put, keys)) == {200}
    with httpx.Client(base_url=d.url, headers=d.headers("alice")) as alice:
        held = _hits(alice, keys)
    # The host tier is the only tier: what alice holds is what the quota allows.
    assert 0 < held * VALUE <= QUOTA
