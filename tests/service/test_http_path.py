"""The daemon's data plane (service/dataplane.py) against a real daemon, over raw sockets.

A one-chunk PUT the data plane takes receives its body straight into a slot of the store
(the protocol copies the parser's pieces into it); what it declines, FastAPI serves
through the same request core, with the same answer bytes. These tests hold what that
must not break: bodies in pieces, ``Expect: 100-continue``, pipelined requests, a client
that goes away mid-body, the request-bytes metric, and the same answer on both paths.
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
import time

import httpx

from .conftest import Daemon, DaemonFactory


def key() -> str:
    return os.urandom(16).hex()


def _addr(d: Daemon) -> tuple[str, int]:
    host, port = d.url.removeprefix("http://").split(":")
    return host, int(port)


def _put_head(k: str, n: int, extra: bytes = b"") -> bytes:
    return (
        f"PUT /v1/chunks/{k} HTTP/1.1\r\nHost: x\r\nContent-Length: {n}\r\n".encode()
        + extra
        + b"\r\n"
    )


def _responses(s: socket.socket, n: int) -> list[tuple[int, bytes]]:
    """Read ``n`` responses with a Content-Length each: (status, body)."""
    buf = b""
    out: list[tuple[int, bytes]] = []
    while len(out) < n:
        end = buf.find(b"\r\n\r\n")
        if end >= 0:
            head = buf[:end].decode("latin-1")
            m = re.search(r"(?im)^content-length:\s*(\d+)", head)
            length = int(m.group(1)) if m else 0
            if len(buf) >= end + 4 + length:
                status = int(head.split(" ", 2)[1])
                if status != 100:
                    out.append((status, buf[end + 4 : end + 4 + length]))
                buf = buf[end + 4 + length :]
                continue
        piece = s.recv(1 << 20)
        if not piece:
            break
        buf += piece
    return out


def test_a_body_sent_in_pieces_is_stored_whole(daemon: Daemon) -> None:
    k, v = key(), os.urandom(700_001)
    with socket.create_connection(_addr(daemon), timeout=20) as s:
        s.sendall(_put_head(k, len(v)) + v[:1000])
        for lo in range(1000, len(v), 150_000):  # later pieces arrive while the route waits
            time.sleep(0.05)
            s.sendall(v[lo : lo + 150_000])
        ((status, body),) = _responses(s, 1)
    assert status == 200 and b'"stored":1' in body.replace(b" ", b"")
    assert httpx.get(f"{daemon.url}/v1/chunks/{k}", timeout=20).content == v


def test_expect_100_continue_gets_its_interim_answer(daemon: Daemon) -> None:
    k, v = key(), os.urandom(300_000)
    with socket.create_connection(_addr(daemon), timeout=20) as s:
        s.sendall(_put_head(k, len(v), b"Expect: 100-continue\r\n"))
        assert s.recv(4096).startswith(b"HTTP/1.1 100 Continue")  # curl waits for it
        s.sendall(v)
        ((status, _),) = _responses(s, 1)
    assert status == 200
    assert httpx.get(f"{daemon.url}/v1/chunks/{k}", timeout=20).content == v


def test_pipelined_puts_and_gets_each_get_their_own_bytes(daemon: Daemon) -> None:
    k1, k2 = key(), key()
    v1, v2 = os.urandom(200_003), os.urandom(90_001)
    get = lambda k: f"GET /v1/chunks/{k} HTTP/1.1\r\nHost: x\r\n\r\n".encode()  # noqa: E731
    with socket.create_connection(_addr(daemon), timeout=20) as s:
        s.sendall(_put_head(k1, len(v1)) + v1 + _put_head(k2, len(v2)) + v2 + get(k1) + get(k2))
        got = _responses(s, 4)
    assert [st for st, _ in got] == [200, 200, 200, 200]
    assert got[2][1] == v1 and got[3][1] == v2


def test_a_client_gone_mid_body_stores_nothing_and_frees_the_key(daemon: Daemon) -> None:
    k = key()
    with socket.create_connection(_addr(daemon), timeout=20) as s:
        s.sendall(_put_head(k, 500_000) + os.urandom(100_000))
    # The slot it had reserved is given back: the key is absent, and a later put of it
    # stores (a reservation still open would make it answer "present").
    with httpx.Client(base_url=daemon.url, timeout=20) as h:
        assert h.get(f"/v1/chunks/{k}").status_code == 404
        v = os.urandom(1000)
        for _ in range(100):  # the daemon notices the hang-up on its own schedule
            r = h.put(f"/v1/chunks/{k}", content=v).json()
            if r["stored"] == 1:
                break
            h.delete(f"/v1/chunks/{k}")
            time.sleep(0.1)
        assert r["stored"] == 1, r
        assert h.get(f"/v1/chunks/{k}").content == v


def _request_bytes(h: httpx.Client) -> int:
    text = h.get("/metrics").text
    m = re.search(r'kvtier_http_request_bytes_total\{route="/v1/chunks/\{key\}"\} (\d+)', text)
    return int(m.group(1)) if m else 0


def test_bodies_received_in_place_are_counted_in_metrics(daemon: Daemon) -> None:
    with httpx.Client(base_url=daemon.url, timeout=20) as h:
        before = _request_bytes(h)
        assert h.put(f"/v1/chunks/{key()}", content=os.urandom(123_457)).status_code == 200
        assert _request_bytes(h) - before == 123_457


def _answers(s: socket.socket, requests: list[bytes]) -> list[tuple[int, dict[str, str], bytes]]:
    """Send each request after the previous answer: (status, headers but date, body)."""
    out = []
    for req in requests:
        s.sendall(req)
        buf = b""
        while b"\r\n\r\n" not in buf:
            buf += s.recv(1 << 20)
        head, _, body = buf.partition(b"\r\n\r\n")
        lines = head.decode("latin-1").split("\r\n")
        headers = dict(line.lower().split(": ", 1) for line in lines[1:])
        while len(body) < int(headers["content-length"]):
            body += s.recv(1 << 20)
        headers.pop("date")
        out.append((int(lines[0].split(" ")[1]), headers, body))
    return out


def _series(h: httpx.Client, pattern: str) -> int:
    m = re.search(pattern + r" (\d+)", h.get("/metrics").text)
    return int(m.group(1)) if m else 0


_DIRECT = "kvtier_http_direct_answers_total"
_GET_200 = r'kvtier_http_requests_total\{route="/v1/chunks/\{key\}",method="GET",status="200"\}'


def test_a_get_answered_below_asgi_is_the_answer_asgi_gives(daemon: Daemon) -> None:
    k, absent, v = key(), key(), os.urandom(300_001)
    get = lambda path: f"GET {path} HTTP/1.1\r\nHost: x\r\n\r\n".encode()  # noqa: E731
    with httpx.Client(base_url=daemon.url, timeout=20) as h:
        assert h.put(f"/v1/chunks/{k}", content=v).status_code == 200
        direct, ok = _series(h, _DIRECT), _series(h, _GET_200)
        with socket.create_connection(_addr(daemon), timeout=20) as s:
            # A query string is not the protocol's to answer: the same GET through ASGI.
            below, asgi, miss_below, miss_asgi = _answers(
                s,
                [
                    get(f"/v1/chunks/{k}"),
                    get(f"/v1/chunks/{k}?via=asgi"),
                    get(f"/v1/chunks/{absent}"),
                    get(f"/v1/chunks/{absent}?via=asgi"),
                ],
            )
        assert below == asgi and below[0] == 200 and below[2] == v
        assert miss_below == miss_asgi and miss_below[0] == 404
        assert b"not_found" in miss_below[2]
        # Two of the four were answered below ASGI; every answer is in the request series.
        assert _series(h, _DIRECT) - direct == 2
        assert _series(h, _GET_200) - ok == 2


def test_a_get_declaring_an_empty_body_is_answered_below_asgi(daemon: Daemon) -> None:
    k, v = key(), os.urandom(1000)
    with httpx.Client(base_url=daemon.url, timeout=20) as h:
        assert h.put(f"/v1/chunks/{k}", content=v).status_code == 200
        direct = _series(h, _DIRECT)
        with socket.create_connection(_addr(daemon), timeout=20) as s:
            req = f"GET /v1/chunks/{k} HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n"
            ((status, _, body),) = _answers(s, [req.encode()])
        assert (status, body) == (200, v)
        assert _series(h, _DIRECT) - direct == 1


def test_pipelined_gets_around_direct_answers_keep_their_order(daemon: Daemon) -> None:
    ks = [key() for _ in range(3)]
    vs = [os.urandom(n) for n in (70_001, 150_003, 5)]
    with httpx.Client(base_url=daemon.url, timeout=20) as h:
        for k, v in zip(ks, vs, strict=True):
            assert h.put(f"/v1/chunks/{k}", content=v).status_code == 200
    paths = [ks[0], f"{ks[1]}?q=1", ks[2], key(), ks[1], f"{ks[0]}?q=2", ks[2]]
    with socket.create_connection(_addr(daemon), timeout=20) as s:
        s.sendall(
            b"".join(f"GET /v1/chunks/{p} HTTP/1.1\r\nHost: x\r\n\r\n".encode() for p in paths)
        )
        got = _responses(s, len(paths))
    assert [st for st, _ in got] == [200, 200, 200, 404, 200, 200, 200]
    assert [b for _, b in got[:3]] == vs and got[4][1] == vs[1]
    assert got[5][1] == vs[0] and got[6][1] == vs[2]


def test_a_put_answered_below_asgi_is_the_answer_asgi_gives(daemon: Daemon) -> None:
    k1, k2, v = key(), key(), os.urandom(200_001)
    put = lambda path: f"PUT {path} HTTP/1.1\r\nHost: x\r\nContent-Length: {len(v)}\r\n\r\n"  # noqa: E731
    with httpx.Client(base_url=daemon.url, timeout=20) as h:
        direct = _series(h, _DIRECT)
        with socket.create_connection(_addr(daemon), timeout=20) as s:
            below, asgi, again = _answers(
                s,
                [
                    put(f"/v1/chunks/{k1}").encode() + v,
                    put(f"/v1/chunks/{k2}?via=asgi").encode() + v,
                    put(f"/v1/chunks/{k1}").encode() + v,  # present: no slot to reserve
                ],
            )
        assert below == asgi and below[0] == 200 and b'"stored": 1' in below[2]
        assert again[0] == 200 and b'"present": 1' in again[2]
        assert _series(h, _DIRECT) - direct == 1
        assert h.get(f"/v1/chunks/{k1}").content == v == h.get(f"/v1/chunks/{k2}").content


def test_a_put_being_received_at_shutdown_is_stored_and_answered(
    daemon_factory: DaemonFactory,
) -> None:
    d = daemon_factory()
    k, v = key(), os.urandom(600_000)
    with socket.create_connection(_addr(d), timeout=20) as s:
        s.sendall(_put_head(k, len(v)) + v[:1000])
        time.sleep(0.3)  # the head is parsed and the PUT taken before the stop
        d.proc.send_signal(signal.SIGTERM)
        time.sleep(0.3)
        s.sendall(v[1000:])
        answer = _answers(s, [b""])[0]
    assert answer[0] == 200 and b'"stored": 1' in answer[2]
    assert answer[1]["connection"] == "close"  # and then the daemon goes on stopping
    assert d.proc.wait(timeout=30) in (0, -signal.SIGTERM)


def test_gets_sent_from_the_tier_arrive_whole_when_the_client_reads_late(daemon: Daemon) -> None:
    # Direct GETs send a value straight from its slot; what the socket does not take at
    # once is copied. A client that pipelines 24 GETs of 1 MiB and reads only after all
    # were sent fills the socket: every answer must still be the value, byte for byte.
    ks = [key() for _ in range(3)]
    vs = [os.urandom(1 << 20) for _ in ks]
    with httpx.Client(base_url=daemon.url, timeout=20) as h:
        for k, v in zip(ks, vs, strict=True):
            assert h.put(f"/v1/chunks/{k}", content=v).status_code == 200
    order = [i % 3 for i in range(24)]
    with socket.create_connection(_addr(daemon), timeout=30) as s:
        s.sendall(
            b"".join(f"GET /v1/chunks/{ks[i]} HTTP/1.1\r\nHost: x\r\n\r\n".encode() for i in order)
        )
        time.sleep(1.0)  # the daemon answers into a socket nobody reads yet
        got = _responses(s, len(order))
    assert [st for st, _ in got] == [200] * len(order)
    assert all(body == vs[i] for (_, body), i in zip(got, order, strict=True))
    with httpx.Client(base_url=daemon.url, timeout=20) as h:  # no hold was left behind
        assert h.delete(f"/v1/chunks/{ks[0]}").status_code == 200


def test_http_1_0_keep_alive_requests_share_one_connection(daemon: Daemon) -> None:
    # HTTP/1.0 clients that ask to keep the connection (ApacheBench's -k) get answers
    # that say so, and their next request is served on the same connection.
    k, v = key(), os.urandom(100_003)
    keep = b"Connection: keep-alive\r\n"
    with socket.create_connection(_addr(daemon), timeout=20) as s:
        put, get, again = _answers(
            s,
            [
                f"PUT /v1/chunks/{k} HTTP/1.0\r\nContent-Length: {len(v)}\r\n".encode()
                + keep
                + b"\r\n"
                + v,
                f"GET /v1/chunks/{k} HTTP/1.0\r\n".encode() + keep + b"\r\n",
                f"GET /v1/chunks/{k} HTTP/1.0\r\n".encode() + keep + b"\r\n",
            ],
        )
    assert put[0] == 200 and b'"stored": 1' in put[2]
    assert get == again and get[0] == 200 and get[2] == v
    assert put[1]["connection"] == get[1]["connection"] == "keep-alive"


def test_an_http_1_0_request_without_keep_alive_ends_its_connection(daemon: Daemon) -> None:
    k, v = key(), os.urandom(1000)
    with httpx.Client(base_url=daemon.url, timeout=20) as h:
        assert h.put(f"/v1/chunks/{k}", content=v).status_code == 200
    with socket.create_connection(_addr(daemon), timeout=20) as s:
        ((status, headers, body),) = _answers(s, [f"GET /v1/chunks/{k} HTTP/1.0\r\n\r\n".encode()])
        assert (status, body) == (200, v) and headers.get("connection") == "close"
        assert s.recv(1) == b""  # closed by the daemon
