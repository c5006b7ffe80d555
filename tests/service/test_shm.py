"""The same-host channel (shared memory over a Unix socket) against real daemons.

Every test talks to a ``kvtier serve`` process through its real socket; hostile frames
are sent with raw sockets, and a dying client is a real child process killed mid-request.
"""

from __future__ import annotations

import pytest

pytest.importorskip("fastapi", reason="needs the service extra: pip install 'kvtier[service]'")
pytest.importorskip("uvicorn", reason="needs the service extra: pip install 'kvtier[service]'")
pytest.importorskip("httpx", reason="needs the service extra: pip install 'kvtier[service]'")

import asyncio
import contextlib
import fcntl
import json
import os
import socket
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import numpy as np
import pytest

from kvtier.errors import AuthError, ConfigError, InputError
from kvtier.service import shm_wire as w
from kvtier.service.client import AsyncClient, Client
from kvtier.service.shm_client import Region
from tests.procs import exited_pid

from .conftest import TOKENS, Daemon, DaemonFactory, free_port, start_daemon

MiB = 1 << 20


def _metric(d: Daemon, name: str, tenant: str | None = None) -> int:
    text = httpx.get(f"{d.url}/metrics", headers=d.headers(tenant)).text
    return sum(
        int(float(line.rsplit(" ", 1)[1]))
        for line in text.splitlines()
        if line.startswith(name) and not line.startswith("#")
    )


def _socket_of(d: Daemon, tenant: str | None = None) -> str:
    r = httpx.get(f"{d.url}/v1/same-host", headers=d.headers(tenant))
    assert r.status_code == 200, r.text
    path = r.json()["socket"]
    assert path
    return str(path)


def _rand(n: int) -> bytes:
    return np.random.default_rng().integers(0, 256, n, dtype=np.uint8).tobytes()


# -- a well-behaved client ------------------------------------------------------------------


def test_client_moves_values_through_shared_memory_bytes_equal(tenant_daemon: Daemon) -> None:
    d = tenant_daemon
    shm_before = _metric(d, "kvtier_same_host_requests_total", "alice")
    http_before = _metric(d, 'kvtier_http_requests_total{route="/v1/chunks/{key}"', "alice")
    keys = [os.urandom(16) for _ in range(6)]
    values = [_rand(MiB), _rand(1000), _rand(1000), _rand(77), _rand(MiB), _rand(5)]
    with Client(d.url, TOKENS["alice"]) as c:
        res = c.put_many(keys, values)
        assert (res.stored, res.present) == (6, 0)
        assert c.put(keys[0], values[0]).present == 1
        hit = c.lookup([*keys, os.urandom(16)])
        assert hit.hits == 6 and hit.value_bytes == tuple(len(v) for v in values)
        assert hit.tiers == ("host",) * 6
        assert c.get(keys[3]) == values[3]
        assert c.get(os.urandom(16)) is None
        assert c.exists(keys[4])
        out = bytearray(sum(map(len, values)))
        got = c.get_into(keys, out)
        assert got.chunks == 6 and bytes(out) == b"".join(values)
        # A buffer too small for the third value ends the run there.
        small = np.zeros(MiB + 1500, np.uint8)
        got = c.get_into(keys, small)
        assert (got.chunks, got.value_bytes) == (2, (MiB, 1000))
        assert c.delete(keys[5]) and not c.exists(keys[5])
    assert _metric(d, "kvtier_same_host_requests_total", "alice") >= shm_before + 9
    # None of it went through the HTTP chunk routes.
    assert _metric(d, 'kvtier_http_requests_total{route="/v1/chunks/{key}"', "alice") == (
        http_before
    )


def test_async_client_moves_values_through_shared_memory_as_the_sync_one(
    tenant_daemon: Daemon,
) -> None:
    d = tenant_daemon
    shm_before = _metric(d, "kvtier_same_host_requests_total", "bob")
    http_before = _metric(d, 'kvtier_http_requests_total{route="/v1/chunks/{key}"', "bob")
    keys = [os.urandom(16) for _ in range(4)]
    values = [_rand(MiB), _rand(1000), _rand(77), _rand(5)]

    async def go() -> None:
        async with AsyncClient(d.url, TOKENS["bob"]) as c:
            assert await c.same_host_socket() == _socket_of(d, "bob")
            results = await asyncio.gather(
                *(c.put(k, v) for k, v in zip(keys[:2], values[:2], strict=True))
            )
            assert sum(r.stored for r in results) == 2
            assert (await c.put_many(keys[2:], values[2:])).stored == 2
            hit = await c.lookup([*keys, os.urandom(16)])
            assert hit.hits == 4 and hit.value_bytes == tuple(len(v) for v in values)
            assert await c.get(keys[2]) == values[2]
            assert await c.get(os.urandom(16)) is None
            buf = await c.shared_buffer(sum(map(len, values)))
            assert await c.is_shared(buf)
            got = await c.get_into(keys, buf)
            assert got.chunks == 4 and bytes(buf) == b"".join(values)
            assert await c.delete(keys[3]) and not await c.exists(keys[3])

    asyncio.run(go())
    assert _metric(d, "kvtier_same_host_requests_total", "bob") >= shm_before + 9
    # None of it went through the HTTP chunk routes.
    assert _metric(d, 'kvtier_http_requests_total{route="/v1/chunks/{key}"', "bob") == (http_before)


def test_async_client_with_same_host_false_uses_http(tenant_daemon: Daemon) -> None:
    d = tenant_daemon
    k, v = os.urandom(16), _rand(3000)

    async def go() -> None:
        async with AsyncClient(d.url, TOKENS["bob"], same_host=False) as c:
            assert await c.same_host_socket() is None
            assert (await c.put(k, v)).stored == 1
            assert await c.get(k) == v

    before = _metric(d, 'kvtier_http_requests_total{route="/v1/chunks/{key}"', "bob")
    asyncio.run(go())
    assert _metric(d, 'kvtier_http_requests_total{route="/v1/chunks/{key}"', "bob") == before + 2


def test_shared_buffers_put_and_get_with_no_client_copy(tenant_daemon: Daemon) -> None:
    with Client(tenant_daemon.url, TOKENS["alice"]) as c:
        src = c.shared_buffer(4 * MiB)
        src[:] = np.frombuffer(_rand(4 * MiB), np.uint8)
        keys = [os.urandom(16) for _ in range(4)]
        assert c.put_many(keys, [src[i * MiB : (i + 1) * MiB].data for i in range(4)]).stored == 4
        dst = c.shared_buffer(4 * MiB)
        got = c.get_into(keys, dst)
        assert got.nbytes == 4 * MiB and np.array_equal(src, dst)
        # A slice in the middle of a shared buffer is addressed in place too.
        dst[:] = 0
        assert c.get_into(keys[2:3], dst[MiB : 2 * MiB]).nbytes == MiB
        assert np.array_equal(dst[MiB : 2 * MiB], src[2 * MiB : 3 * MiB])
        assert not dst[:MiB].any() and not dst[2 * MiB :].any()


def test_more_shared_buffers_than_a_connection_maps_at_once(tenant_daemon: Daemon) -> None:
    with Client(tenant_daemon.url, TOKENS["alice"]) as c:
        bufs = [c.shared_buffer(4096) for _ in range(w.MAX_REGIONS + 5)]
        keys = [os.urandom(16) for _ in bufs]
        for i, (k, b) in enumerate(zip(keys, bufs, strict=True)):
            b[:] = i
            assert c.put(k, b.data).stored == 1
        for i, (k, b) in enumerate(zip(keys, bufs, strict=True)):  # again, oldest first
            b[:] = 255
            assert c.get_into([k], b).nbytes == 4096 and (b == i).all()


def test_two_tokens_never_see_each_others_chunks(tenant_daemon: Daemon) -> None:
    d = tenant_daemon
    keys = [os.urandom(16) for _ in range(3)]
    vals = [_rand(4096) for _ in keys]
    with Client(d.url, TOKENS["alice"]) as alice, Client(d.url, TOKENS["bob"]) as bob:
        assert alice.put_many(keys, vals).stored == 3
        assert bob.lookup(keys).hits == 0
        assert bob.get(keys[0]) is None
        assert bob.get_into(keys, bytearray(3 * 4096)).chunks == 0
        assert not bob.delete(keys[1])
        assert bob.put(keys[2], b"bob's").stored == 1
        assert bob.get(keys[2]) == b"bob's"
        assert alice.get(keys[2]) == vals[2] and alice.lookup(keys).hits == 3
        assert alice._shm is not None and bob._shm is not None  # both went same-host
    # Over HTTP, alice's chunks stored through shared memory are hers as well.
    with Client(d.url, TOKENS["alice"], same_host=False) as http_alice:
        assert http_alice.get(keys[0]) == vals[0]


def test_a_wrong_token_is_refused_on_the_socket(tenant_daemon: Daemon) -> None:
    path = _socket_of(tenant_daemon, "alice")
    from kvtier.service.shm_client import SameHost

    with pytest.raises(AuthError):
        SameHost(path, "not-a-token")


def test_same_host_false_and_a_daemon_without_socket_use_http(
    daemon_factory: DaemonFactory,
) -> None:
    d = daemon_factory("--set", "service.socket=")
    assert httpx.get(f"{d.url}/v1/same-host").json() == {"socket": None, "version": 1}
    with Client(d.url) as c:
        assert c.put(os.urandom(16), b"x" * 10).stored == 1
        assert c._shm is None
    assert _metric(d, "kvtier_same_host_requests_total") == 0


# -- hostile clients ------------------------------------------------------------------------


def _raw(path: str) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    s.settimeout(10)
    s.connect(path)
    return s


def _ask(s: socket.socket, frame: bytes, fds: list[int] | None = None) -> tuple[int, bytes]:
    if fds:
        socket.send_fds(s, [frame], fds)
    else:
        s.send(frame)
    msg = s.recv(65536)
    assert len(msg) >= w.REPLY.size, msg
    return msg[4], msg[w.REPLY.size :]


def _hello(s: socket.socket, token: str) -> None:
    status, body = _ask(s, w.request(w.Op.HELLO, count=len(token)) + token.encode())
    assert status == w.Status.OK, body
    assert json.loads(body)["max_batch_keys"] >= 1


def _memfd(n: int, *, seal: bool = True, name: str = "t") -> int:
    fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    os.ftruncate(fd, n)
    if seal:
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK)
    return fd


def test_hostile_frames_are_refused_and_the_daemon_keeps_serving(
    tenant_daemon: Daemon, tmp_path: Path
) -> None:
    d = tenant_daemon
    path = _socket_of(d, "alice")
    token = TOKENS["alice"]
    key = os.urandom(16)

    # Garbage is refused; a request before HELLO, or a wrong token, ends the connection.
    s = _raw(path)
    assert _ask(s, b"\x00garbage")[0] == w.Status.BAD_REQUEST
    assert _ask(s, b"X" * 100)[0] == w.Status.BAD_REQUEST
    assert _ask(s, w.request(w.Op.LOOKUP, count=1) + key)[0] == w.Status.UNAUTHORIZED
    assert s.recv(100) == b""  # closed by the daemon
    s.close()
    s = _raw(path)
    assert _ask(s, w.request(w.Op.HELLO, count=5) + b"wrong")[0] == w.Status.UNAUTHORIZED
    assert s.recv(100) == b""
    s.close()

    s = _raw(path)
    _hello(s, token)
    unknown_op = bytearray(w.request(w.Op.LOOKUP, count=1) + key)
    unknown_op[4] = 99
    assert _ask(s, bytes(unknown_op))[0] == w.Status.BAD_REQUEST
    assert _ask(s, w.request(w.Op.HELLO, count=len(token)) + token.encode())[0] == 1  # twice
    # Counts that lie, or exceed the daemon's bound, and a frame over the bound.
    assert _ask(s, w.request(w.Op.LOOKUP, count=3) + key)[0] == w.Status.BAD_REQUEST
    assert _ask(s, w.request(w.Op.LOOKUP, count=1) + key + b"x")[0] == w.Status.BAD_REQUEST
    assert _ask(s, w.request(w.Op.LOOKUP, count=2**32 - 1) + key)[0] == w.Status.TOO_LARGE
    huge = w.request(w.Op.LOOKUP, count=4096) + os.urandom(16 * 4096)  # over 1024 keys
    assert _ask(s, huge)[0] == w.Status.TOO_LARGE
    # MAP without a descriptor, with two, with a regular file, a pipe, an unsealed memfd,
    # a region larger than the memfd or than the daemon maps.
    assert _ask(s, w.request(w.Op.MAP, region=1, length=4096))[0] == w.Status.BAD_REQUEST
    two = [_memfd(4096), _memfd(4096)]
    assert _ask(s, w.request(w.Op.MAP, region=1, length=4096), two)[0] == w.Status.BAD_REQUEST
    f = tmp_path / "plain"
    f.write_bytes(b"\0" * 4096)
    plain = os.open(f, os.O_RDWR)
    r, wr = os.pipe()
    unsealed = _memfd(4096, seal=False)
    small = _memfd(4096)
    for fd, length in ((plain, 4096), (r, 4096), (unsealed, 4096), (small, 8192)):
        status, why = _ask(s, w.request(w.Op.MAP, region=1, length=length), [fd])
        assert status == w.Status.BAD_REQUEST, why
    assert _ask(s, w.request(w.Op.MAP, region=1, length=2**62), [small])[0] == w.Status.TOO_LARGE
    # A descriptor sent with any other op is refused (and closed by the daemon).
    assert _ask(s, w.request(w.Op.LOOKUP, count=1) + key, [small])[0] == w.Status.BAD_REQUEST
    # PUT/GET into an unmapped region, or outside a mapped one, or split unevenly.
    assert _ask(s, w.request(w.Op.PUT, region=7, count=1, length=10) + key)[0] == 1
    assert _ask(s, w.request(w.Op.MAP, region=1, length=4096), [small])[0] == w.Status.OK
    outside = w.request(w.Op.GET, region=1, count=1, offset=4000, length=200) + key
    assert _ask(s, outside)[0] == w.Status.BAD_REQUEST
    uneven = w.request(w.Op.PUT, region=1, count=2, length=101) + key + os.urandom(16)
    assert _ask(s, uneven)[0] == w.Status.BAD_REQUEST
    dup = w.request(w.Op.PUT, region=1, count=2, length=100) + key + key
    assert _ask(s, dup)[0] == w.Status.BAD_REQUEST
    # After all that, this very connection still serves a good request.
    status, body = _ask(s, w.request(w.Op.PUT, region=1, count=1, length=64) + key)
    assert status == w.Status.OK and w.PUT_COUNTS.unpack_from(body)[0] == 1
    for fd in (*two, plain, r, wr, unsealed, small):
        os.close(fd)
    s.close()

    # And a new client sees the value the hostile connection stored, as alice's.
    with Client(d.url, token) as c:
        assert c.get(key) == b"\0" * 64
        assert c._shm is not None
    assert _metric(d, 'kvtier_same_host_requests_total{op="lookup",status="bad_request"', "alice")


def _mappings_of(pid: int, memfd_name: str) -> tuple[int, int]:
    """Process ``pid``'s mappings of memfd ``memfd_name``: how many, and how many of their
    bytes its page tables map (the ``Rss`` of those areas in /proc/PID/smaps)."""
    areas = total = 0
    inside = False
    for line in Path(f"/proc/{pid}/smaps").read_text().splitlines():
        first = line.split(" ", 1)[0]
        if "-" in first and all(c in "0123456789abcdef-" for c in first):  # an area's head
            inside = f"/memfd:{memfd_name} " in line
            areas += inside
        elif inside and line.startswith("Rss:"):
            total += int(line.split()[1]) * 1024
    return areas, total


def _mapped_bytes(pid: int, memfd_name: str) -> int:
    return _mappings_of(pid, memfd_name)[1]


def test_a_whole_region_is_mapped_populated_and_a_sparse_one_allocates_nothing(
    tenant_daemon: Daemon,
) -> None:
    # Populated: a store's first write into a lazily mapped page faults inside a request.
    # Not populated where the client left holes: the daemon must not allocate them.
    d = tenant_daemon
    s = _raw(_socket_of(d, "alice"))
    _hello(s, TOKENS["alice"])
    n = 8 * MiB
    whole = _memfd(n, name="kvtier-test-whole")
    os.posix_fallocate(whole, 0, n)  # the client's memory all there, as Client makes it
    sparse = _memfd(n, name="kvtier-test-sparse")
    assert _ask(s, w.request(w.Op.MAP, region=1, length=n), [whole])[0] == w.Status.OK
    assert _ask(s, w.request(w.Op.MAP, region=2, length=n), [sparse])[0] == w.Status.OK
    assert _mapped_bytes(d.proc.pid, "kvtier-test-whole") >= n
    assert _mapped_bytes(d.proc.pid, "kvtier-test-sparse") == 0
    assert os.fstat(sparse).st_blocks == 0
    # Both serve: a put from each region, a get into the other.
    ka, kb = os.urandom(16), os.urandom(16)
    for region, key in ((1, ka), (2, kb)):
        status, _ = _ask(s, w.request(w.Op.PUT, region=region, count=1, length=4096) + key)
        assert status == w.Status.OK
    status, _ = _ask(s, w.request(w.Op.GET, region=2, count=1, offset=4096, length=4096) + ka)
    assert status == w.Status.OK
    for fd in (whole, sparse):
        os.close(fd)
    s.close()


def test_connections_handing_over_one_memfd_share_one_mapping(tenant_daemon: Daemon) -> None:
    # A client pools connections, each mapping the regions it uses: one mapping (one
    # populate, one set of page tables) serves them all, and goes with the last of them.
    d = tenant_daemon
    path = _socket_of(d, "alice")
    n = 4 * MiB
    fd = _memfd(n, name="kvtier-test-shared")
    os.posix_fallocate(fd, 0, n)
    conns = [_raw(path) for _ in range(3)]
    for s in conns:
        _hello(s, TOKENS["alice"])
        assert _ask(s, w.request(w.Op.MAP, region=5, length=n), [fd])[0] == w.Status.OK
    assert _mappings_of(d.proc.pid, "kvtier-test-shared") == (1, n)
    # Each connection still names it by its own region id, and reads what another wrote.
    key = os.urandom(16)
    put = w.request(w.Op.PUT, region=5, count=1, offset=0, length=4096) + key
    assert _ask(conns[0], put)[0] == w.Status.OK
    get = w.request(w.Op.GET, region=5, count=1, offset=8192, length=4096) + key
    assert _ask(conns[2], get)[0] == w.Status.OK
    # UNMAP on one and a closed connection leave the others' mapping; the last one ends it.
    assert _ask(conns[0], w.request(w.Op.UNMAP, region=5))[0] == w.Status.OK
    conns[1].close()
    assert _ask(conns[2], get)[0] == w.Status.OK
    assert _mappings_of(d.proc.pid, "kvtier-test-shared")[0] == 1
    conns[2].close()
    deadline = time.monotonic() + 10
    while _mappings_of(d.proc.pid, "kvtier-test-shared")[0] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _mappings_of(d.proc.pid, "kvtier-test-shared")[0] == 0
    conns[0].close()
    os.close(fd)


def test_a_client_region_is_all_allocated_and_resident_when_made() -> None:
    # The daemon populates its mapping only of a memfd its client allocated whole; the
    # client's own first writes must not fault either.
    region = Region(1, 8 * MiB)
    try:
        assert os.fstat(region.fd).st_blocks * 512 >= 8 * MiB
        areas, rss = _mappings_of(os.getpid(), "kvtier-shm")
        assert areas >= 1 and rss >= 8 * MiB
    finally:
        region.close()
        del region


def test_a_shared_buffer_is_mapped_by_the_daemon_when_it_is_made(tenant_daemon: Daemon) -> None:
    # Not inside the first request that uses it: that request would pay the populate.
    d = tenant_daemon
    with Client(d.url, TOKENS["alice"]) as c:
        assert c.lookup([os.urandom(16)]).hits == 0  # the channel is up
        areas, rss = _mappings_of(d.proc.pid, "kvtier-shm")
        buf = c.shared_buffer(8 * MiB)
        assert _mappings_of(d.proc.pid, "kvtier-shm") == (areas + 1, rss + 8 * MiB)
        key = os.urandom(16)
        buf[:4096] = 7
        c.put(key, buf[:4096].data)
        assert c.get_into([key], buf[4096:8192]).nbytes == 4096
        assert (buf[4096:8192] == 7).all()
        assert _mappings_of(d.proc.pid, "kvtier-shm")[0] == areas + 1  # no second mapping


def test_a_client_killed_mid_request_leaves_the_daemon_serving(
    tenant_daemon: Daemon, tmp_path: Path
) -> None:
    d = tenant_daemon
    path = _socket_of(d, "alice")
    keys = [os.urandom(16) for _ in range(8)]
    with Client(d.url, TOKENS["alice"]) as c:
        assert c.put_many(keys, [_rand(MiB) for _ in keys]).stored == 8
    child = textwrap.dedent(
        f"""
        import fcntl, os, socket, sys
        sys.path.insert(0, {str(Path(__file__).parents[2])!r})
        from kvtier.service import shm_wire as w
        s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        s.connect({path!r})
        tok = {TOKENS["alice"]!r}.encode()
        s.send(w.request(w.Op.HELLO, count=len(tok)) + tok); s.recv(4096)
        fd = os.memfd_create("c", os.MFD_ALLOW_SEALING)
        os.ftruncate(fd, 8 << 20)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK)
        socket.send_fds(s, [w.request(w.Op.MAP, region=1, length=8 << 20)], [fd]); s.recv(4096)
        keys = b"".join(bytes.fromhex(k) for k in {[k.hex() for k in keys]!r})
        for _ in range(20):
            s.send(w.request(w.Op.GET, region=1, count=8, length=8 << 20) + keys)
        os._exit(0)  # dies with its requests in flight, never reading a reply
        """
    )
    for _ in range(3):
        subprocess.run([sys.executable, "-c", child], check=True, timeout=60)
    with Client(d.url, TOKENS["alice"]) as c:
        out = c.shared_buffer(8 * MiB)
        assert c.get_into(keys, out).chunks == 8
    assert d.proc.poll() is None


# -- restarts and shutdown ------------------------------------------------------------------


def test_a_restarted_daemon_is_found_again_and_http_covers_the_gap(
    daemon_factory: DaemonFactory, tmp_path: Path
) -> None:
    port = free_port()
    first = start_daemon(tmp_path, tokens=TOKENS, port=port)
    old_path = Path(_socket_of(first, "alice"))
    key, value = os.urandom(16), _rand(3000)
    with Client(first.url, TOKENS["alice"]) as c:
        assert c.put(key, value).stored == 1
        assert c._shm is not None
        assert first.stop() in (0, -15)
        assert not old_path.exists() and not old_path.parent.exists()  # removed at shutdown
        second = daemon_factory(tokens=TOKENS, port=port)
        # The old socket is gone: this call falls back to HTTP (a miss: memory tiers only) ...
        assert c.get(key) is None
        assert c.put(key, value).stored == 1
        # ... and once the hold-off passes, the new daemon's socket is used.
        deadline = time.monotonic() + 20
        while c._shm is None and time.monotonic() < deadline:
            time.sleep(0.3)
            assert c.get(key) == value
        assert c._shm is not None and c._shm.path == _socket_of(second, "alice")
    assert _metric(second, "kvtier_same_host_requests_total", "alice") > 0


def test_a_configured_socket_path_is_private_and_removed_at_stop(
    daemon_factory: DaemonFactory, tmp_path: Path
) -> None:
    where = tmp_path / "run" / "kv.sock"
    d = daemon_factory("--set", f"service.socket={where}")
    assert _socket_of(d) == str(where)
    assert where.stat().st_mode & 0o777 == 0o600
    assert where.parent.stat().st_mode & 0o777 == 0o700
    with Client(d.url) as c:
        assert c.put(os.urandom(16), b"anonymous").stored == 1
        assert c._shm is not None
    assert d.stop() in (0, -15)
    assert not where.exists()


def test_a_killed_daemons_socket_folder_is_swept_by_the_next_daemon(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    # A short base: a Unix socket path must stay under 108 bytes.
    with tempfile.TemporaryDirectory(prefix="kvs-") as base:
        monkeypatch.setenv("XDG_RUNTIME_DIR", base)
        killed = start_daemon(tmp_path)
        left = Path(_socket_of(killed)).parent
        assert left.parent == Path(base) and left.name.startswith(f"kvtier-{killed.proc.pid}-")
        killed.proc.kill()
        killed.proc.wait()
        assert (left / "daemon.sock").exists()  # SIGKILL: nothing removed it
        second = start_daemon(tmp_path)
        try:
            assert not left.exists()
            assert "removed 1 socket folder(s) left by dead daemons" in second.log.read_text()
            mine = Path(_socket_of(second)).parent
            with Client(second.url) as c:
                assert c.put(os.urandom(16), b"after the sweep").stored == 1
                assert c._shm is not None and c._shm.path == str(mine / "daemon.sock")
        finally:
            assert second.stop() in (0, -15)
        assert not mine.exists()
        assert os.listdir(base) == []


def test_the_socket_sweep_leaves_what_is_not_a_dead_daemons_folder(tmp_path: Path) -> None:
    from kvtier.service.shm import sweep_stale_socket_dirs

    gone = exited_pid()
    stale = tmp_path / f"kvtier-{gone}-stale"
    extra = tmp_path / f"kvtier-{gone}-extra"  # holds something else: not ours to judge
    live_pid = tmp_path / f"kvtier-{os.getpid()}-live"
    listened = tmp_path / f"kvtier-{gone}-listened"  # e.g. a daemon of another pid namespace
    other = tmp_path / "kvtier-demo-x"
    # Earlier versions named the folder kvtier-XXXXXXXX: no pid, so only a dead socket counts.
    legacy_stale = tmp_path / "kvtier-ab_cd123"
    legacy_empty = tmp_path / "kvtier-ef_gh456"  # e.g. an old daemon before its bind
    legacy_listened = tmp_path / "kvtier-ij_kl789"
    dirs = (stale, extra, live_pid, listened, other, legacy_stale, legacy_empty, legacy_listened)
    for d in dirs:
        d.mkdir()
    (extra / "notes.txt").write_text("keep")
    for d in (stale, legacy_stale):
        with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as s:
            s.bind(str(d / "daemon.sock"))  # bound, then closed: nobody listens
    with (
        socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as listener,
        socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as legacy_listener,
    ):
        listener.bind(str(listened / "daemon.sock"))
        listener.listen(1)
        legacy_listener.bind(str(legacy_listened / "daemon.sock"))
        legacy_listener.listen(1)
        assert sweep_stale_socket_dirs(tmp_path) == 2
    assert not stale.exists() and not legacy_stale.exists()
    kept = (extra, live_pid, listened, other, legacy_empty, legacy_listened)
    assert all(d.exists() for d in kept)


def test_bad_socket_settings_are_one_line_config_errors() -> None:
    from kvtier.config import load_config

    with pytest.raises(ConfigError, match="socket_max_region_bytes"):
        load_config(overrides=["service.socket_max_region_bytes=10"])
    with pytest.raises(ConfigError, match=r"service\.socket"):
        load_config(overrides=["service.socket=/" + "x" * 200])


def test_client_input_errors_are_not_channel_failures(tenant_daemon: Daemon) -> None:
    with Client(tenant_daemon.url, TOKENS["alice"]) as c:
        with pytest.raises(InputError):
            c.put(os.urandom(16), b"")
        with pytest.raises(InputError):  # over the daemon's max_value_bytes (1 MiB)
            c.put(os.urandom(16), b"x" * (MiB + 1))
        assert c._shm is not None


def test_a_put_prefix_keeps_a_long_sequence_head_on_a_full_daemon(tmp_path: Path) -> None:
    """A daemon of four 1 MiB slots, a 12-chunk sequence put two chunks per request (as
    chunked prefill saves it). Without a prefix each request evicts the sequence's oldest
    chunks, its head, and the store ends with a tail no lookup reaches; with each
    request naming the chunks before it, the head stays and the tail is declined."""
    d = start_daemon(
        tmp_path, "--set", "tiers.0.capacity_bytes=4MiB", "--set", "store.placement=keep"
    )
    try:
        with Client(d.url) as c:
            assert c.same_host_socket is not None
            for protect in (False, True):
                seq = [os.urandom(16) for _ in range(12)]
                values = [_rand(MiB) for _ in seq]
                for i in range(0, 12, 2):
                    c.put_many(seq[i : i + 2], values[i : i + 2], prefix=seq[:i] if protect else ())
                hit = c.lookup(seq)
                if protect:
                    assert hit.hits == 4  # the head, the whole store
                    out = bytearray(4 * MiB)
                    assert c.get_into(seq, out).chunks == 4
                    assert bytes(out) == b"".join(values[:4])
                else:
                    assert hit.hits == 0  # what the daemon did before prefixes
                for k in seq:
                    c.delete(k)
        # Hostile prefixes: on another op, more than the key limit, or a payload short
        # of the keys it announces; each is refused and the connection keeps serving.
        s = _raw(_socket_of(d))
        _hello(s, "")
        key = os.urandom(16)
        assert _ask(s, w.request(w.Op.LOOKUP, count=1, extra=1) + key + key)[0] == (
            w.Status.BAD_REQUEST
        )
        assert _ask(s, w.request(w.Op.PUT, count=1, extra=1 << 20, length=1) + key)[0] in (
            w.Status.BAD_REQUEST,
            w.Status.TOO_LARGE,
        )
        assert _ask(s, w.request(w.Op.PUT, count=1, extra=2, length=1) + key + key)[0] == (
            w.Status.BAD_REQUEST
        )
        assert _ask(s, w.request(w.Op.LOOKUP, count=1) + key)[0] == w.Status.OK
        s.close()
    finally:
        d.stop()


# -- what a client without a token can hold -------------------------------------------------


def _fds_of(pid: int) -> list[str]:
    """Where each open descriptor of process ``pid`` points."""
    out = []
    for fd in os.listdir(f"/proc/{pid}/fd"):
        with contextlib.suppress(FileNotFoundError):
            out.append(os.readlink(f"/proc/{pid}/fd/{fd}"))
    return out


def _fds_down_to(pid: int, before: int) -> int:
    """How many descriptors ``pid`` has once it is back to ``before`` (or 10 s passed):
    the HTTP connections the metrics reads opened close a moment after their answer."""
    n = len(_fds_of(pid))
    deadline = time.monotonic() + 10
    while n > before and time.monotonic() < deadline:
        time.sleep(0.05)
        n = len(_fds_of(pid))
    return n


def test_descriptors_sent_on_empty_messages_are_closed(daemon_factory: DaemonFactory) -> None:
    d = daemon_factory(tokens=TOKENS)
    pid = d.proc.pid
    path = _socket_of(d, "alice")
    with Client(d.url, TOKENS["alice"]) as c:  # the daemon's own descriptors, all open
        assert c.get(os.urandom(16)) is None
    assert _wait_for_connections(d, lambda n: n == 0) == 0
    before = len(_fds_of(pid))
    for _ in range(20):  # no token, no HELLO: a 4 MiB memfd on an empty message
        s = _raw(path)
        fd = _memfd(4 * MiB, name="kvtier-hostile-empty")
        socket.send_fds(s, [b""], [fd])
        os.close(fd)
        assert s.recv(100) == b""  # the daemon ends the connection
        s.close()
    assert _wait_for_connections(d, lambda n: n == 0) == 0
    held = [t for t in _fds_of(pid) if "kvtier-hostile-empty" in t]
    assert held == []
    assert _fds_down_to(pid, before) <= before
    with Client(d.url, TOKENS["alice"]) as c:
        key = os.urandom(16)
        c.put(key, b"v" * 100)
        assert c.get(key) == b"v" * 100


def _wait_for_connections(d: Daemon, ok: Callable[[int], bool]) -> int:
    n = -1
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        n = _metric(d, "kvtier_same_host_connections", "alice")
        if ok(n):
            break
        time.sleep(0.05)
    return n


def test_a_connection_that_does_not_authenticate_is_closed_at_the_deadline(
    daemon_factory: DaemonFactory,
) -> None:
    d = daemon_factory("--set", "service.socket_auth_timeout_s=5", tokens=TOKENS)
    pid = d.proc.pid
    path = _socket_of(d, "alice")
    with Client(d.url, TOKENS["alice"]) as c:
        assert c.get(os.urandom(16)) is None
    assert _wait_for_connections(d, lambda n: n == 0) == 0
    before = len(_fds_of(pid))
    idle = [_raw(path) for _ in range(8)]
    # Each holds a slot (and a descriptor) for now.
    assert _wait_for_connections(d, lambda n: n >= 8) >= 8
    # One that keeps sending frames, none of them a HELLO, is no better off.
    busy = _raw(path)
    closed = False
    for _ in range(600):
        try:
            status, _ = _ask(busy, b"\x00garbage")
        except (AssertionError, OSError):
            closed = True
            break
        assert status == w.Status.BAD_REQUEST
        time.sleep(0.1)
    assert closed
    for s in idle:
        assert s.recv(100) == b""  # closed by the daemon, never by this client
    # An authenticated connection has no deadline: it serves past the one above.
    s = _raw(path)
    _hello(s, TOKENS["alice"])
    time.sleep(6)
    assert _ask(s, w.request(w.Op.LOOKUP, count=1) + os.urandom(16))[0] == w.Status.OK
    s.close()
    for s in [*idle, busy]:
        s.close()
    assert _wait_for_connections(d, lambda n: n == 0) == 0
    assert _fds_down_to(pid, before) <= before
