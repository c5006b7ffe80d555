"""Per-tenant, per-tier figures of a real daemon: /v1/stats, /metrics and ``kvtier tenants``.

Four tenants over a host tier and an nvme tier: alice (a host quota of four slots, so her
oldest chunks are evicted down to nvme), bob (named, no host limit), and carol and dave,
whom the configuration does not name: their figures fold into one ``(other)`` row.
"""

from __future__ import annotations

import pytest

pytest.importorskip("fastapi", reason="needs the service extra: pip install 'kvtier[service]'")
pytest.importorskip("httpx", reason="needs the service extra: pip install 'kvtier[service]'")

import json
import os
import subprocess
from typing import Any

import httpx

from .conftest import Daemon, DaemonFactory, free_port, kvtier_cmd

VALUE = 256 << 10  # one slot of every tier (service.max_value_bytes)
TOKENS = {
    "alice": "alice-token-0123456789",
    "bob": "bob-token-0123456789ab",
    "carol": "carol-token-0123456789",
    "dave": "dave-token-0123456789a",
}
ARGS = (
    "--set",
    f"service.max_value_bytes={VALUE}",
    "--set",
    "service.data_capacity_bytes=16MiB",
    "--set",
    "store.placement=keep",  # every victim goes down to nvme: evictions are exact
    "--set",
    "store.promote_on_hit=false",  # a read from nvme moves nothing
    "--set",
    f"tenants.quotas.alice.host={4 * VALUE}",
    "--set",
    "tenants.quotas.bob.nvme=8MiB",
    "--set",
    f"tenants.default_quota.host={8 * VALUE}",
)


@pytest.fixture(scope="module")
def figures_daemon(
    daemon_factory: DaemonFactory, tmp_path_factory: pytest.TempPathFactory
) -> Daemon:
    data = tmp_path_factory.mktemp("figures-data")
    return daemon_factory(*ARGS, "--data-dir", str(data), tokens=TOKENS)


def _keys(n: int) -> list[str]:
    return [os.urandom(16).hex() for _ in range(n)]


def _client(d: Daemon, tenant: str) -> httpx.Client:
    return httpx.Client(base_url=d.url, headers=d.headers(tenant))


def _put(c: httpx.Client, keys: list[str]) -> None:
    for k in keys:  # one at a time: the oldest are evicted first
        assert c.put(f"/v1/chunks/{k}", content=os.urandom(VALUE)).json()["stored"] == 1


def _tier(t: str, **figures: int | None) -> dict[str, Any]:
    row: dict[str, Any] = dict.fromkeys(
        (
            "lookup_hit_chunks",
            "read_chunks",
            "read_bytes",
            "stored_chunks",
            "stored_bytes",
            "evicted_chunks",
            "quota_used_bytes",
        ),
        0,
    )
    return {"tier": t, **row, "quota_limit_bytes": None, **figures}


@pytest.fixture(scope="module")
def worked(figures_daemon: Daemon) -> Daemon:
    """The daemon after known puts, lookups and gets of each tenant."""
    d = figures_daemon
    alice_keys, bob_keys = _keys(6), _keys(3)
    with _client(d, "alice") as alice, _client(d, "bob") as bob:
        _put(alice, alice_keys)  # 4 fit her host quota: the 2 oldest go down to nvme
        found = alice.post("/v1/lookup", json={"keys": [*alice_keys, *_keys(1)]}).json()
        assert found == {"hits": 6, "tiers": ["nvme"] * 2 + ["host"] * 4}
        assert alice.get(f"/v1/chunks/{alice_keys[5]}").status_code == 200  # from host
        assert alice.get(f"/v1/chunks/{alice_keys[0]}").status_code == 200  # from nvme
        _put(bob, bob_keys)
        assert bob.post("/v1/lookup", json={"keys": bob_keys}).json()["hits"] == 3
        assert bob.get(f"/v1/chunks/{bob_keys[0]}").status_code == 200
    for tenant, n in (("carol", 2), ("dave", 1)):
        with _client(d, tenant) as c:
            keys = _keys(n)
            _put(c, keys)
            assert c.post("/v1/lookup", json={"keys": [*_keys(1), *keys]}).json()["hits"] == 0
    return d


NVME_SLOT = VALUE  # 256 KiB is a multiple of the nvme tier's 4 KiB alignment

EXPECTED = [
    {"tenant": "alice", "lookup_miss_chunks": 1, "tiers": [
        _tier("host", lookup_hit_chunks=4, read_chunks=1, read_bytes=VALUE, stored_chunks=6,
              stored_bytes=6 * VALUE, evicted_chunks=2, quota_used_bytes=4 * VALUE,
              quota_limit_bytes=4 * VALUE),
        _tier("nvme", lookup_hit_chunks=2, read_chunks=1, read_bytes=VALUE, stored_chunks=2,
              stored_bytes=2 * VALUE, quota_used_bytes=2 * NVME_SLOT),
    ]},
    {"tenant": "bob", "lookup_miss_chunks": 0, "tiers": [
        _tier("host", lookup_hit_chunks=3, read_chunks=1, read_bytes=VALUE, stored_chunks=3,
              stored_bytes=3 * VALUE, quota_used_bytes=3 * VALUE),
        _tier("nvme", quota_limit_bytes=8 << 20),
    ]},
    {"tenant": "anonymous", "lookup_miss_chunks": 0, "tiers": [
        _tier("host", quota_limit_bytes=8 * VALUE),
        _tier("nvme"),
    ]},
    # carol and dave, folded: a lookup that misses its first key misses them all.
    {"tenant": "(other)", "lookup_miss_chunks": (1 + 2) + (1 + 1), "tiers": [
        _tier("host", stored_chunks=3, stored_bytes=3 * VALUE, quota_used_bytes=3 * VALUE,
              quota_limit_bytes=8 * VALUE),
        _tier("nvme"),
    ]},
]  # fmt: skip


def _by_tenant(rows: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {r["tenant"]: r for r in rows}


def test_stats_give_each_named_tenants_figures_per_tier_and_fold_the_others(worked: Daemon) -> None:
    with _client(worked, "carol") as c:  # any tenant's token reads them
        got = c.get("/v1/stats").json()["tenants"]
    assert [r["tenant"] for r in got][-1] == "(other)"
    assert _by_tenant(got) == _by_tenant(EXPECTED)


def test_metrics_carry_the_same_figures_under_bounded_labels(worked: Daemon) -> None:
    with _client(worked, "bob") as c:
        text = c.get("/metrics").text
    lines = [ln for ln in text.splitlines() if ln.startswith("kvtier_tenant_tier_")]
    assert 'kvtier_tenant_tier_stored_chunks_total{tenant="alice",tier="host"} 6' in lines
    assert 'kvtier_tenant_tier_evicted_chunks_total{tenant="alice",tier="host"} 2' in lines
    assert f'kvtier_tenant_tier_read_bytes_total{{tenant="alice",tier="nvme"}} {VALUE}' in lines
    limit = f'kvtier_tenant_tier_quota_limit_bytes{{tenant="alice",tier="host"}} {4 * VALUE}'
    assert limit in lines
    assert 'kvtier_tenant_tier_stored_chunks_total{tenant="(other)",tier="host"} 3' in lines
    assert 'kvtier_tenant_store_lookup_miss_chunks_total{tenant="alice"} 1' in text.splitlines()
    # Unlimited: no limit series. Unnamed tenants: no series of their own.
    assert not any('tenant="bob",tier="host"' in ln for ln in lines if "quota_limit" in ln)
    labels = {ln.split('tenant="')[1].split('"')[0] for ln in lines if "tenant=" in ln}
    assert labels == {"alice", "bob", "anonymous", "(other)"}


def _cli(d: Daemon, *args: str, token: str | None = None) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVTIER_")}
    if token:
        env["KVTIER_TOKEN"] = token
    return subprocess.run(
        [*kvtier_cmd(), "tenants", "--url", d.url, *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )


def test_the_tenants_command_prints_them_as_json_and_as_a_table(worked: Daemon) -> None:
    out = _cli(worked, "--json", token=TOKENS["dave"])
    assert out.returncode == 0, out.stderr
    assert _by_tenant(json.loads(out.stdout)) == _by_tenant(EXPECTED)

    out = _cli(worked, token=TOKENS["alice"])
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    (header,) = [[c.strip() for c in ln.split("┃")[1:-1]] for ln in lines if "┃" in ln]
    body = [[c.strip() for c in ln.split("│")[1:-1]] for ln in lines if "│" in ln]
    assert header == [
        "tenant",
        "tier",
        "lookup hits",
        "lookup misses",
        "reads",
        "read bytes",
        "stored",
        "stored bytes",
        "evicted",
        "quota used",
        "quota",
    ]
    assert ["alice", "host", "4", "1", "1", "256.00 KiB", "6", "1.50 MiB", "2", "1.00 MiB",
            "1.00 MiB"] in body  # fmt: skip
    assert ["", "nvme", "2", "", "1", "256.00 KiB", "2", "512.00 KiB", "0", "512.00 KiB",
            "unlimited"] in body  # fmt: skip
    assert ["(other)", "host", "0", "5", "0", "0 B", "3", "768.00 KiB", "0", "768.00 KiB",
            "2.00 MiB"] in body  # fmt: skip


def test_the_tenants_command_refuses_a_bad_token_and_says_when_there_are_no_figures(
    worked: Daemon, daemon: Daemon
) -> None:
    out = _cli(worked, token="not-a-token")
    assert out.returncode == 2
    assert "error:" in out.stderr
    out = subprocess.run(
        [*kvtier_cmd(), "tenants", "--url", f"http://127.0.0.1:{free_port()}"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 2  # nothing listens there
    assert "error:" in out.stderr
    out = _cli(daemon)  # a daemon without [tenants]
    assert out.returncode == 1
    assert "[tenants]" in out.stderr


def test_the_tenants_command_says_a_malformed_url_in_one_line() -> None:
    out = subprocess.run(
        [*kvtier_cmd(), "tenants", "--url", "http://[::1"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 2
    assert "Traceback" not in out.stderr
    assert "an http:// or https:// URL" in out.stderr
