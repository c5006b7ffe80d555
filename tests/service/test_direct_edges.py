"""Edges of the answers given in the HTTP protocol, below ASGI (service/dataplane.py), each
against a real daemon over raw sockets: what the connection does after a direct answer,
at its keep-alive timer, and at shutdown, where uvicorn's own request cycle is absent.
"""

from __future__ import annotations

import pytest

pytest.importorskip("fastapi", reason="needs the service extra: pip install 'kvtier[service]'")
pytest.importorskip("uvicorn", reason="needs the service extra: pip install 'kvtier[service]'")
pytest.importorskip("httpx", reason="needs the service extra: pip install 'kvtier[service]'")

import signal
import socket
import time
from pathlib import Path

import httpx

from .conftest import Daemon, DaemonFactory
from .test_http_path import _addr, _put_head, _responses, key


def _get(path: str) -> bytes:
    return f"GET {path} HTTP/1.1\r\nHost: x\r\n\r\n".encode()


def test_closing_a_connection_after_a_direct_answer_logs_no_error(
    daemon_factory: DaemonFactory,
) -> None:
    d = daemon_factory()
    k = key()
    with socket.create_connection(_addr(d), timeout=20) as s:
        s.sendall(_put_head(k, 5) + b"abcde" + _get(f"/v1/chunks/{k}"))
        assert [st for st, _ in _responses(s, 2)] == [200, 200]
    with httpx.Client(base_url=d.url, timeout=20) as h:  # the daemon saw the close by now
        assert "kvtier_http_direct_answers_total 2" in h.get("/metrics").text
    assert "Traceback" not in d.log.read_text()


def test_a_request_read_with_a_direct_answer_outlives_the_keep_alive_timer(
    daemon: Daemon,
) -> None:
    k, k2 = key(), key()
    assert httpx.put(f"{daemon.url}/v1/chunks/{k}", content=b"v" * 100).status_code == 200
    with socket.create_connection(_addr(daemon), timeout=20) as s:
        # The GET is answered inside the read that also holds the next PUT's head; its
        # body comes after uvicorn's 5 s keep-alive timeout, which must not be running.
        s.sendall(_get(f"/v1/chunks/{k}") + _put_head(k2, 10))
        time.sleep(6.5)
        s.sendall(b"0123456789")
        got = _responses(s, 2)
    assert [st for st, _ in got] == [200, 200], got
    assert httpx.get(f"{daemon.url}/v1/chunks/{k2}").content == b"0123456789"


def test_a_stalled_direct_put_does_not_hold_shutdown_past_its_grace(
    daemon_factory: DaemonFactory,
) -> None:
    d = daemon_factory("--set", "service.shutdown_timeout_s=2")
    with socket.create_connection(_addr(d), timeout=30) as s:
        s.sendall(_put_head(key(), 1000) + b"x" * 10)  # 990 bytes never come
        time.sleep(0.5)
        t0 = time.monotonic()
        d.proc.send_signal(signal.SIGTERM)
        assert d.proc.wait(timeout=20) in (0, -signal.SIGTERM)
        assert time.monotonic() - t0 < 15  # the grace, then the PUT is dropped
    assert "store closed" in d.log.read_text()


def test_a_request_behind_the_last_answer_at_shutdown_is_not_run(
    daemon_factory: DaemonFactory, tmp_path: Path
) -> None:
    args = ("--data-dir", str(tmp_path / "data"), "--set", "service.shutdown_timeout_s=5")
    d = daemon_factory(*args)
    k1, k2 = key(), key()
    assert httpx.put(f"{d.url}/v1/chunks/{k2}", content=b"keep").status_code == 200
    with socket.create_connection(_addr(d), timeout=20) as s:
        s.sendall(_put_head(k1, 100) + b"x" * 10)
        time.sleep(0.5)
        d.proc.send_signal(signal.SIGTERM)
        time.sleep(1.0)
        # The PUT's answer closes the connection; a DELETE read with it gets no answer,
        # so it must not run either.
        s.sendall(b"x" * 90 + f"DELETE /v1/chunks/{k2} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
        got = _responses(s, 2)
    assert [st for st, _ in got] == [200]
    assert d.proc.wait(timeout=30) in (0, -signal.SIGTERM)
    again = daemon_factory(*args)
    with httpx.Client(base_url=again.url, timeout=20) as h:
        assert h.get(f"/v1/chunks/{k1}").content == b"x" * 100
        assert h.get(f"/v1/chunks/{k2}").content == b"keep"
