"""The sync client's own HTTP/1.1 reader against a server that answers as it likes.

A real TCP server on loopback writes each answer in the pieces a test chooses (a head
split byte by byte, a body cut short, a body longer than its Content-Length), so the
reader's paths for a head in one segment or several, and for large bodies read straight
into their bytes, meet real sockets.
"""

from __future__ import annotations

import pytest

pytest.importorskip("fastapi", reason="needs the service extra: pip install 'kvtier[service]'")
pytest.importorskip("uvicorn", reason="needs the service extra: pip install 'kvtier[service]'")
pytest.importorskip("httpx", reason="needs the service extra: pip install 'kvtier[service]'")

import os
import socket
import threading
import time
from collections.abc import Callable, Iterator

import httpx
import pytest

from kvtier.service.transport import RawHTTP

Answer = Callable[[socket.socket], None]


@pytest.fixture
def server() -> Iterator[Callable[[Answer], str]]:
    """Serve each connection with the answer given: ``url = server(answer)``."""
    lsock = socket.create_server(("127.0.0.1", 0))
    answer: list[Answer] = []

    def loop() -> None:
        while True:
            try:
                conn, _ = lsock.accept()
            except OSError:
                return
            with conn:
                try:
                    conn.recv(65536)  # the request (small: a GET)
                    answer[0](conn)
                except OSError:
                    pass

    t = threading.Thread(target=loop, daemon=True)
    t.start()

    def start(a: Answer) -> str:
        answer[:] = [a]
        return f"http://127.0.0.1:{lsock.getsockname()[1]}"

    yield start
    lsock.shutdown(socket.SHUT_RDWR)  # wakes the accept (Linux); close alone does not
    lsock.close()
    t.join(5)


def _head(n: int) -> bytes:
    return (
        b"HTTP/1.1 200 OK\r\nContent-Type: application/octet-stream\r\nContent-Length: %d\r\n\r\n"
        % n
    )


@pytest.mark.parametrize("size", [0, 100, 300_000, 8 << 20])
def test_a_head_written_byte_by_byte_then_the_body(
    server: Callable[[Answer], str], size: int
) -> None:
    body = os.urandom(size)

    def answer(conn: socket.socket) -> None:
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        for b in _head(size):
            conn.sendall(bytes([b]))
            time.sleep(0.0005)
        conn.sendall(body)

    h = RawHTTP(server(answer), timeout_s=10)
    status, _, got = h.request("GET", "/x", b"", [])
    assert status == 200 and got == body


@pytest.mark.parametrize("size", [100, 300_000, 32 << 20])
def test_head_and_body_in_one_write(server: Callable[[Answer], str], size: int) -> None:
    body = os.urandom(size)
    h = RawHTTP(server(lambda conn: conn.sendall(_head(size) + body)), timeout_s=10)
    status, headers, got = h.request("GET", "/x", b"", [])
    assert status == 200 and headers["content-length"] == str(size) and got == body


@pytest.mark.parametrize("size", [300_000, 8 << 20])
def test_a_body_cut_short_is_an_error_not_short_bytes(
    server: Callable[[Answer], str], size: int
) -> None:
    def answer(conn: socket.socket) -> None:
        conn.sendall(_head(size))
        time.sleep(0.05)  # the head alone first: the body is read in one buffered read
        conn.sendall(os.urandom(size // 2))

    h = RawHTTP(server(answer), timeout_s=10)
    with pytest.raises(httpx.RemoteProtocolError, match="mid-body"):
        h.request("GET", "/x", b"", [])


def test_a_server_that_stops_writing_mid_body_times_out(server: Callable[[Answer], str]) -> None:
    done = threading.Event()

    def answer(conn: socket.socket) -> None:
        conn.sendall(_head(1 << 20) + b"x" * 1000)
        done.wait(10)

    h = RawHTTP(server(answer), timeout_s=0.5)
    try:
        with pytest.raises(httpx.ReadTimeout):
            h.request("GET", "/x", b"", [])
    finally:
        done.set()
