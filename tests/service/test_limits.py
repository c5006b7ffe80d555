"""Issue 11 against real daemons: error mapping on the fast path, request-head limits,
no body read before authentication, a bound on bodies in flight, a hung Redis, and
duplicate Authorization headers.

Every test here failed on 07784f0 (see the note of issue 11). None asserts a duration:
"does not stall" is checked as an order of events (healthz answered while requests to
a hung Redis are still pending).
"""

from __future__ import annotations

import pytest

pytest.importorskip("fastapi", reason="needs the service extra: pip install 'kvtier[service]'")
pytest.importorskip("uvicorn", reason="needs the service extra: pip install 'kvtier[service]'")
pytest.importorskip("httpx", reason="needs the service extra: pip install 'kvtier[service]'")

import os
import signal
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from .conftest import TOKENS, Daemon, DaemonFactory

MiB = 1 << 20


def key() -> str:
    return os.urandom(16).hex()


def _addr(d: Daemon) -> tuple[str, int]:
    host, port = d.url.removeprefix("http://").split(":")
    return host, int(port)


def _send_head(d: Daemon, head: bytes, body: bytes = b"") -> socket.socket:
    s = socket.create_connection(_addr(d), timeout=20)
    s.sendall(head + body)
    return s


def _status(s: socket.socket) -> int:
    """The status code of the first response on ``s`` (waits up to its timeout)."""
    data = b""
    while b"\r\n" not in data:
        piece = s.recv(4096)
        if not piece:
            break
        data += piece
    return int(data.split(b" ", 2)[1]) if data else 0


def test_fast_path_get_of_a_value_over_the_current_limit_is_a_400_not_a_500(
    daemon_factory: DaemonFactory, tmp_path: Path
) -> None:
    # Values of exactly 1 MiB land on the nvme tier; the restart lowers max_value_bytes to
    # a size that rounds up to the same slot, so they are recovered but do not fit.
    args = [
        "--data-dir",
        str(tmp_path),
        "--set",
        "tiers.0.capacity_bytes=2MiB",
        "--set",
        "service.data_capacity_bytes=16MiB",
        "--set",
        "store.placement=keep",
    ]
    first = daemon_factory(*args)
    keys = [key() for _ in range(4)]
    with httpx.Client(base_url=first.url, timeout=30) as h:
        for k in keys:
            assert h.put(f"/v1/chunks/{k}", content=os.urandom(MiB)).json()["stored"] == 1
    first.stop()
    second = daemon_factory(*args, "--set", f"service.max_value_bytes={MiB - 4095}")
    with httpx.Client(base_url=second.url, timeout=30) as h:
        present = [k for k in keys if h.head(f"/v1/chunks/{k}").status_code == 200]
        assert present, "no value survived the restart"
        for k in present:
            r = h.get(f"/v1/chunks/{k}")  # the fast path: 500 before the fix
            assert r.status_code == 400, r.text
            assert r.json()["code"] == "bad_input"
            r = h.post("/v1/batch/get", json={"keys": [k]})  # the batch get: the same
            assert r.status_code in (200, 400), r.text


def test_a_huge_request_head_is_refused_with_431(daemon: Daemon) -> None:
    s = socket.create_connection(_addr(daemon), timeout=20)
    try:
        s.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Big: ")
        try:
            for _ in range(64):  # 4 MiB of one header value, far over the 32 KiB default
                s.sendall(b"a" * 65536)
        except OSError:
            pass  # the daemon answered and closed: the rest is not read
        assert _status(s) == 431  # before the fix: parsed in full (quadratic), then 200
    finally:
        s.close()
    assert httpx.get(f"{daemon.url}/healthz", timeout=10).status_code == 200


@pytest.fixture(scope="module")
def limited(daemon_factory: DaemonFactory) -> Daemon:
    """Two tenants and a 4 MiB bound on bodies in flight."""
    return daemon_factory(
        "--set",
        "service.max_body_bytes=4MiB",
        "--set",
        "service.max_inflight_bytes=4MiB",
        tokens=TOKENS,
    )


def test_a_slow_request_head_is_disconnected(daemon: Daemon) -> None:
    # A byte a second keeps resetting uvicorn's idle timer; the head timeout (10 s by
    # default) counts from the head's first byte.
    s = socket.create_connection(_addr(daemon), timeout=2)
    closed = False
    try:
        s.sendall(b"GET /healthz HTTP/1.1\r\n")
        for _ in range(40):
            try:
                s.sendall(b"X")
                if s.recv(4096) == b"":
                    closed = True
                    break
            except TimeoutError:
                continue
            except OSError:
                closed = True
                break
    finally:
        s.close()
    assert closed, "a head trickling in for 80 s was never cut off"


def test_no_body_is_read_before_authentication_and_size_checks(tenant_daemon: Daemon) -> None:
    head = (
        b"POST /v1/lookup HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Content-Length: 200000000\r\n"
    )
    # No token: 401 at once, though not one byte of the 200 MB body was sent.
    s = _send_head(tenant_daemon, head + b"\r\n")
    try:
        assert _status(s) == 401
    finally:
        s.close()
    # A token, but more than max_batch_keys keys could ever take: 413 at once.
    token = TOKENS["alice"].encode()
    s = _send_head(tenant_daemon, head + b"Authorization: Bearer " + token + b"\r\n\r\n")
    try:
        assert _status(s) == 413
    finally:
        s.close()


def test_bodies_in_flight_are_bounded_with_503_and_retry_after(limited: Daemon) -> None:
    auth = f"Authorization: Bearer {TOKENS['alice']}\r\n".encode()
    held = _send_head(
        limited,
        b"POST /v1/batch/put HTTP/1.1\r\nHost: x\r\n" + auth + b"Content-Length: 3670016\r\n\r\n",
        b"\0" * 1000,  # a body that is slow to arrive holds its declared bytes
    )
    try:
        with httpx.Client(base_url=limited.url, headers=limited.headers("alice")) as h:
            deadline = time.monotonic() + 30
            while "kvtier_http_requests_in_flight 2" not in h.get("/metrics").text:
                assert time.monotonic() < deadline, "the held request never arrived"
                time.sleep(0.05)
            r = h.put(f"/v1/chunks/{key()}", content=os.urandom(MiB))  # 3.5 + 1 > 4 MiB
            assert r.status_code == 503, r.text
            assert r.json()["code"] == "busy"
            assert r.headers["retry-after"]
    finally:
        held.close()
    with httpx.Client(base_url=limited.url, headers=limited.headers("alice")) as h:
        deadline = time.monotonic() + 30
        while True:  # the held bytes come back once the daemon sees the connection gone
            r = h.put(f"/v1/chunks/{key()}", content=os.urandom(MiB))
            if r.status_code != 503 or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        assert r.status_code == 200, r.text


def test_a_put_received_below_asgi_holds_its_bytes_in_flight(limited: Daemon) -> None:
    """A one-chunk PUT taken by the protocol (no ASGI request) counts against
    service.max_inflight_bytes while its body arrives, and gives the bytes back when its
    client goes away."""
    auth = f"Authorization: Bearer {TOKENS['alice']}\r\n".encode()
    held = _send_head(
        limited,
        f"PUT /v1/chunks/{key()} HTTP/1.1\r\nHost: x\r\n".encode()
        + auth
        + f"Content-Length: {MiB}\r\n\r\n".encode(),
        b"\0" * 1000,
    )
    big = f"/v1/chunks/{key()}?bulk=1"  # a query string: the ASGI path, which waits or 503s
    try:
        with httpx.Client(base_url=limited.url, headers=limited.headers("alice")) as h:
            deadline = time.monotonic() + 30
            while "kvtier_http_requests_in_flight 2" not in h.get("/metrics").text:
                assert time.monotonic() < deadline, "the held PUT never arrived"
                time.sleep(0.05)
            batch = h.post("/v1/batch/put", content=b"\0" * (3 * MiB + MiB // 2))
            assert batch.status_code == 503, batch.text  # 1 + 3.5 > 4 MiB
            assert h.put(big, content=os.urandom(MiB)).status_code == 200  # 1 + 1 fits
    finally:
        held.close()
    with httpx.Client(base_url=limited.url, headers=limited.headers("alice")) as h:
        deadline = time.monotonic() + 30
        while "kvtier_http_requests_in_flight 1" not in h.get("/metrics").text:
            assert time.monotonic() < deadline, "the held PUT was never given up"
            time.sleep(0.05)
        # Its bytes are back: 3.5 MiB fits again (a body that is not a batch: 400, not 503).
        assert h.post("/v1/batch/put", content=b"\0" * (3 * MiB + MiB // 2)).status_code == 400


def test_duplicate_authorization_headers_are_refused(tenant_daemon: Daemon) -> None:
    both = [
        ("Authorization", f"Bearer {TOKENS['alice']}"),
        ("Authorization", f"Bearer {TOKENS['bob']}"),
    ]
    k = key()
    with httpx.Client(base_url=tenant_daemon.url) as h:
        # The fast path took the last header and the routes the first: now both refuse.
        for method, path in (("GET", f"/v1/chunks/{k}"), ("GET", "/v1/stats")):
            r = h.request(method, path, headers=httpx.Headers(both))
            assert r.status_code == 400, (path, r.text)
            assert r.json()["code"] == "duplicate_authorization"


@pytest.mark.redis
def test_a_hung_redis_is_a_miss_and_does_not_stall_the_daemon(
    daemon_factory: DaemonFactory, fresh_redis, tmp_path: Path
) -> None:
    cfg = tmp_path / "kvtier.toml"
    cfg.write_text(f"""
[service]
data_dir = ""
key_salt = "a-salt-for-this-test-only"

[[tiers]]
kind = "host"
capacity_bytes = "64MiB"

[[tiers]]
kind = "redis"
capacity_bytes = "64MiB"
url = "{fresh_redis.url}"
key_prefix = "hung-{os.getpid()}"
op_budget_s = 4.0
socket_timeout_s = 4.0
backoff_min_s = 60.0
backoff_max_s = 120.0
""")
    d = daemon_factory("--config", str(cfg))
    assert fresh_redis.proc is not None
    os.kill(fresh_redis.proc.pid, signal.SIGSTOP)
    try:
        with ThreadPoolExecutor(4) as pool, httpx.Client(base_url=d.url, timeout=60) as h:
            ready = threading.Barrier(5)

            def head() -> int:
                with httpx.Client(base_url=d.url, timeout=60) as c:
                    ready.wait()
                    return c.head(f"/v1/chunks/{key()}").status_code

            heads = [pool.submit(head) for _ in range(4)]
            ready.wait()
            time.sleep(0.5)  # let the HEADs reach the hung Redis
            assert h.get("/healthz").status_code == 200
            # Before the fix the event loop sat in a blocking probe: healthz came after.
            assert not any(f.done() for f in heads), "a HEAD finished before healthz"
            assert [f.result() for f in heads] == [404] * 4  # a hung Redis is a miss
            ready_body = h.get("/readyz").json()
            assert ready_body["status"] == "degraded"
            assert "redis" in ready_body["tiers_down"]
            assert 'kvtier_tier_up{tier="redis",kind="redis"} 0' in h.get("/metrics").text
            assert 'kvtier_tier_up{tier="host",kind="host"} 1' in h.get("/metrics").text
    finally:
        os.kill(fresh_redis.proc.pid, signal.SIGCONT)


def test_a_request_over_the_bound_waits_for_room(limited: Daemon) -> None:
    """A put that does not fit waits (service.inflight_wait_s, 2 s by default) and is
    served once the request holding the bytes ends; before, it was refused at once."""
    auth = f"Authorization: Bearer {TOKENS['alice']}\r\n".encode()
    held = _send_head(
        limited,
        b"POST /v1/batch/put HTTP/1.1\r\nHost: x\r\n" + auth + b"Content-Length: 3670016\r\n\r\n",
        b"\0" * 1000,
    )
    with httpx.Client(base_url=limited.url, headers=limited.headers("alice")) as h:
        try:
            deadline = time.monotonic() + 30
            while "kvtier_http_requests_in_flight 2" not in h.get("/metrics").text:
                assert time.monotonic() < deadline, "the held request never arrived"
                time.sleep(0.05)
            release = threading.Timer(0.3, held.close)  # the holder goes away mid-wait
            release.start()
            k = key()
            value = os.urandom(MiB)
            r = h.put(f"/v1/chunks/{k}", content=value)  # 3.5 + 1 > 4 MiB until then
            release.join()
            assert r.status_code == 200, r.text
            assert h.get(f"/v1/chunks/{k}").content == value
        finally:
            held.close()
