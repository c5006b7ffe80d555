"""Tenant isolation and authentication against a real daemon with two tenants."""

from __future__ import annotations

import pytest

pytest.importorskip("fastapi", reason="needs the service extra: pip install 'kvtier[service]'")
pytest.importorskip("uvicorn", reason="needs the service extra: pip install 'kvtier[service]'")
pytest.importorskip("httpx", reason="needs the service extra: pip install 'kvtier[service]'")

import os
import subprocess

import httpx
import pytest

from kvtier.service import wire

from .conftest import TOKENS, Daemon, free_port, kvtier_cmd


@pytest.fixture(scope="module")
def alice(tenant_daemon: Daemon):
    with httpx.Client(base_url=tenant_daemon.url, headers=tenant_daemon.headers("alice")) as c:
        yield c


@pytest.fixture(scope="module")
def bob(tenant_daemon: Daemon):
    with httpx.Client(base_url=tenant_daemon.url, headers=tenant_daemon.headers("bob")) as c:
        yield c


def test_second_tenant_gets_neither_hits_nor_existence_answers(
    alice: httpx.Client, bob: httpx.Client
) -> None:
    ks = [os.urandom(16).hex() for _ in range(3)]
    vals = [os.urandom(5000) for _ in ks]
    for k, v in zip(ks, vals, strict=True):
        assert alice.put(f"/v1/chunks/{k}", content=v).json()["stored"] == 1
    assert alice.post("/v1/lookup", json={"keys": ks}).json()["hits"] == 3

    # Bob names the very same keys and learns nothing.
    for k in ks:
        assert bob.get(f"/v1/chunks/{k}").status_code == 404
        assert bob.head(f"/v1/chunks/{k}").status_code == 404
    assert bob.post("/v1/lookup", json={"keys": ks}).json() == {"hits": 0, "tiers": []}
    got = wire.parse(
        bob.post("/v1/batch/get", json={"keys": ks}).content, max_count=3, max_value_bytes=1 << 20
    )
    assert got.keys == ()
    # ... cannot delete them ...
    assert bob.delete(f"/v1/chunks/{ks[0]}").json() == {"deleted": 0}
    # ... and his own put of the same key neither sees nor replaces alice's value.
    assert bob.put(f"/v1/chunks/{ks[1]}", content=b"bob's").json()["stored"] == 1
    assert bob.get(f"/v1/chunks/{ks[1]}").content == b"bob's"
    assert alice.get(f"/v1/chunks/{ks[1]}").content == vals[1]
    assert alice.post("/v1/lookup", json={"keys": ks}).json()["hits"] == 3


def test_per_tenant_stats_count_only_the_callers_work(
    alice: httpx.Client, bob: httpx.Client
) -> None:
    before = bob.get("/v1/stats").json()["tenant"]
    alice.put(f"/v1/chunks/{os.urandom(16).hex()}", content=b"z" * 100)
    after = bob.get("/v1/stats").json()["tenant"]
    assert after["name"] == "bob"
    assert after["put_chunks"] == before["put_chunks"]


@pytest.mark.parametrize(
    "headers",
    [
        {},
        {"Authorization": "Bearer wrong-token-0123456789"},
        {"Authorization": f"Basic {TOKENS['alice']}"},
        {"Authorization": "Bearer"},
        {"Authorization": TOKENS["alice"]},
    ],
)
def test_requests_without_a_valid_token_are_refused(tenant_daemon: Daemon, headers: dict) -> None:
    k = os.urandom(16).hex()
    for method, path in (
        ("GET", f"/v1/chunks/{k}"),
        ("POST", "/v1/lookup"),
        ("GET", "/v1/stats"),
        ("GET", "/metrics"),
    ):
        r = httpx.request(method, tenant_daemon.url + path, headers=headers, json={"keys": [k]})
        assert r.status_code == 401, (method, path, r.text)
        assert r.headers["www-authenticate"] == "Bearer"
        assert r.json()["code"] == "unauthorized"


def test_health_endpoints_need_no_token(tenant_daemon: Daemon) -> None:
    assert httpx.get(f"{tenant_daemon.url}/healthz").status_code == 200
    assert httpx.get(f"{tenant_daemon.url}/readyz").status_code == 200


@pytest.mark.parametrize("host", ["0.0.0.0", "example.com"])
def test_daemon_refuses_a_non_loopback_bind_without_tokens(host: str) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVTIER_")}
    r = subprocess.run(
        [*kvtier_cmd(), "serve", "--host", host, "--port", str(free_port())],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    assert r.returncode == 2
    assert "service.tokens" in r.stderr
    assert "not loopback" in r.stderr.replace("\n", " ")


def test_weak_tokens_are_refused_at_start_up() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVTIER_")}
    env["KVTIER_SERVICE__TOKENS__ALICE"] = "short"
    r = subprocess.run(
        [*kvtier_cmd(), "serve", "--port", str(free_port())],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    assert r.returncode == 2
    assert "service.tokens.alice" in r.stderr
    assert "short" not in r.stderr  # a token never appears in a message


def test_a_raw_header_value_names_the_tenant_its_text_names() -> None:
    from kvtier.service.tenants import Authenticator

    auth = Authenticator(TOKENS)
    tok = TOKENS["alice"].encode()
    forms = [
        b"Bearer " + tok,
        b"bearer " + tok,
        b"BEARER  " + tok + b"  ",
        b"Bearer " + tok[:-1],
        b"Bearer " + tok + b"x",
        b"Basic " + tok,
        b"Bearer \xff",
        b"Bearer ",
        b"",
        tok,
    ]
    for value in forms:
        assert auth.authenticate_header(value) == auth.authenticate(value.decode("latin-1"))
    assert auth.authenticate_header(b"Bearer " + tok) is not None
    assert auth.authenticate_header(None) is None
    assert Authenticator({}).authenticate_header(None) is not None  # the anonymous tenant
