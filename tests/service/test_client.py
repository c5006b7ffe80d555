"""The Python clients (sync and async) against a real daemon, and their retry and error paths."""

from __future__ import annotations

import pytest

pytest.importorskip("fastapi", reason="needs the service extra: pip install 'kvtier[service]'")
pytest.importorskip("uvicorn", reason="needs the service extra: pip install 'kvtier[service]'")
pytest.importorskip("httpx", reason="needs the service extra: pip install 'kvtier[service]'")

import asyncio
import json
import os

import httpx
import numpy as np
import pytest

from kvtier.errors import AuthError, InputError, TransportError
from kvtier.service import wire
from kvtier.service.client import AsyncClient, Client
from kvtier.service.protocol import BatchSink, RetryPolicy

from .conftest import TOKENS, Daemon, DaemonFactory, free_port

MiB = 1 << 20
FAST_RETRY = RetryPolicy(retries=2, backoff_s=0.001)


@pytest.fixture(scope="module")
def client(tenant_daemon: Daemon):
    with Client(tenant_daemon.url, TOKENS["alice"]) as c:
        yield c


def test_single_value_round_trip(client: Client) -> None:
    k, v = os.urandom(16), os.urandom(123_457)
    assert client.get(k) is None
    assert not client.exists(k)
    assert client.put(k, v).stored == 1
    assert client.exists(k.hex())
    assert client.get(k) == v
    assert client.put(k, v).present == 1
    assert client.delete(k) is True
    assert client.get(k) is None


def test_batches_split_under_the_limits_and_stop_at_the_first_miss(tenant_daemon: Daemon) -> None:
    with Client(tenant_daemon.url, TOKENS["alice"], batch_keys=2, max_body_bytes=40_000) as c:
        ks = [os.urandom(16) for _ in range(7)]
        vals = [os.urandom(n) for n in (10_000, 10_000, 10_000, 30_000, 5, 5, 5)]
        assert c.put_many(ks, vals).stored == 7
        assert c.put_many(ks, vals).present == 7
        assert c.lookup(ks).hits == 7
        assert c.get_many(ks) == vals
        gap = [*ks[:5], os.urandom(16), ks[5]]
        assert c.lookup(gap).hits == 5
        assert c.get_many(gap) == vals[:5]
        buf = np.zeros(100_000, np.uint8)
        got = c.get_into(gap, buf)
        assert got.chunks == 5
        assert got.value_bytes == tuple(len(v) for v in vals[:5])
        assert bytes(buf[: got.nbytes]) == b"".join(vals[:5])


def test_get_into_stops_at_the_first_value_that_does_not_fit(client: Client) -> None:
    ks = [os.urandom(16) for _ in range(3)]
    vals = [os.urandom(1000) for _ in ks]
    client.put_many(ks, vals)
    buf = bytearray(2500)
    got = client.get_into(ks, buf)
    assert (got.chunks, got.nbytes) == (2, 2000)
    assert bytes(buf[:2000]) == vals[0] + vals[1]


def test_truncated_batch_gets_are_continued(daemon_factory: DaemonFactory) -> None:
    # Responses are capped at 3 MiB: two 1 MiB values per answer, the client asks again.
    d = daemon_factory("--set", "service.max_body_bytes=3MiB")
    with Client(d.url, max_body_bytes=3 * MiB) as c:
        ks = [os.urandom(16) for _ in range(5)]
        vals = [os.urandom(MiB) for _ in ks]
        assert c.put_many(ks, vals).stored == 5
        buf = np.empty(5 * MiB, np.uint8)
        got = c.get_into(ks, buf)
        assert got.chunks == 5
        assert bytes(buf) == b"".join(vals)
        assert c.get_many(ks) == vals


def test_async_client_shares_the_same_behaviour(tenant_daemon: Daemon) -> None:
    async def go() -> None:
        async with AsyncClient(tenant_daemon.url, TOKENS["bob"], batch_keys=3) as c:
            ks = [os.urandom(16) for _ in range(5)]
            vals = [os.urandom(2048) for _ in ks]
            results = await asyncio.gather(*(c.put(k, v) for k, v in zip(ks, vals, strict=True)))
            assert sum(r.stored for r in results) == 5
            assert (await c.lookup(ks)).hits == 5
            assert await c.get(ks[2]) == vals[2]
            assert await c.get_many(ks) == vals
            buf = np.empty(5 * 2048, np.uint8)
            assert (await c.get_into(ks, buf)).chunks == 5
            assert bytes(buf) == b"".join(vals)
            assert await c.exists(ks[0]) and await c.delete(ks[0])
            assert await c.ready()

    asyncio.run(go())


def test_refused_token_is_an_auth_error(tenant_daemon: Daemon) -> None:
    with (
        Client(tenant_daemon.url, "not-a-token-0123456789", retry=FAST_RETRY) as c,
        pytest.raises(AuthError, match="401"),
    ):
        c.get(os.urandom(16))


def test_refused_request_is_an_input_error(client: Client) -> None:
    with pytest.raises(InputError, match="413"):
        client.put(os.urandom(16), bytes(MiB + 1))
    with pytest.raises(InputError):
        client.put("not-a-key", b"x")


def test_unreachable_daemon_is_a_transport_error_after_retries() -> None:
    with Client(f"http://127.0.0.1:{free_port()}", retry=FAST_RETRY, connect_timeout_s=0.5) as c:
        with pytest.raises(TransportError, match="ConnectError"):
            c.lookup([os.urandom(16)])
        assert c.ready() is False


def test_retries_ride_out_a_daemon_answering_503() -> None:
    # A daemon that is briefly unavailable cannot be produced on demand: mock the transport.
    calls = []

    def handler(request: httpx.Request) -> httpx.Response:
        calls.append(request.url.path)
        if len(calls) < 3:
            return httpx.Response(503, json={"code": "not_ready", "message": "starting"})
        return httpx.Response(200, json={"hits": 1, "tiers": ["host"]})

    with Client(
        "http://kvtier.test", retry=FAST_RETRY, transport=httpx.MockTransport(handler)
    ) as c:
        assert c.lookup([os.urandom(16)]).hits == 1
    assert calls == ["/v1/lookup"] * 3

    calls.clear()
    with (
        Client(
            "http://kvtier.test",
            retry=RetryPolicy(retries=1, backoff_s=0.001),
            transport=httpx.MockTransport(handler),
        ) as c,
        pytest.raises(TransportError, match="503"),
    ):
        c.lookup([os.urandom(16)])


def test_batch_sink_parses_a_body_fed_one_byte_at_a_time() -> None:
    ks = [os.urandom(16) for _ in range(3)]
    vals = [os.urandom(n) for n in (7, 1, 300)]
    body = bytes(wire.pack(ks, vals))
    dst = bytearray(400)
    sink = BatchSink(memoryview(dst))
    for i in range(len(body)):
        sink.feed(body[i : i + 1])
    assert sink.result() == (3, (7, 1, 300), False)
    assert bytes(dst[:308]) == b"".join(vals)
    sink.reset()
    with pytest.raises(TransportError):
        sink.result()
    sink.feed(body[:-1])
    with pytest.raises(TransportError, match="ended after"):
        sink.result()


def test_bad_json_from_a_broken_daemon_is_a_transport_error() -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(
            200,
            content=json.dumps({"stored": "many"}).encode(),
            headers={"content-type": "application/json"},
        )

    with (
        Client("http://kvtier.test", transport=httpx.MockTransport(handler)) as c,
        pytest.raises(TransportError, match="unexpected put answer"),
    ):
        c.put(os.urandom(16), b"v")


def test_client_reconnects_when_a_stopped_daemon_returns(daemon_factory: DaemonFactory) -> None:
    first = daemon_factory()
    port = int(first.url.rsplit(":", 1)[1])
    with Client(first.url, retry=FAST_RETRY, connect_timeout_s=1) as c:
        k = os.urandom(16)
        assert c.put(k, b"before").stored == 1  # leaves a kept-alive connection in the pool
        first.stop()
        with pytest.raises(TransportError):
            c.get(k)
        second = daemon_factory(port=port)
        # The host tier starts empty: a miss, not an error, on a fresh connection.
        assert c.get(k) is None
        assert c.put(k, b"after").stored == 1
        assert c.get(k) == b"after"
        second.stop()


def test_chunked_upload_takes_the_documented_route(daemon: Daemon) -> None:
    k, v = os.urandom(16).hex(), os.urandom(70_000)

    def pieces():
        yield v[:30_000]
        yield v[30_000:]

    with httpx.Client(base_url=daemon.url) as h:
        r = h.put(f"/v1/chunks/{k}", content=pieces())  # no Content-Length: chunked
        assert r.status_code == 200, r.text
        assert h.get(f"/v1/chunks/{k}").content == v
        big = h.put(f"/v1/chunks/{os.urandom(16).hex()}", content=iter([bytes(MiB), b"x"]))
        assert big.status_code == 413
        assert big.json()["code"] == "body_too_large"


def test_threads_sharing_one_client_never_see_each_others_bytes(daemon: Daemon) -> None:
    # The pooled transport hands connections between threads: a mix-up would show as
    # one thread reading another's value.
    from concurrent.futures import ThreadPoolExecutor

    with Client(daemon.url, pool=4) as c:

        def work(t: int) -> int:
            checked = 0
            for _ in range(15):
                ks = [os.urandom(16) for _ in range(3)]
                vals = [os.urandom(1000 + 37 * t) for _ in ks]
                c.put(ks[0], vals[0])
                c.put_many(ks[1:], vals[1:])
                assert c.get(ks[0]) == vals[0]
                buf = bytearray(3 * len(vals[0]))
                got = c.get_into(ks, buf)
                assert got.chunks == 3
                assert bytes(buf) == b"".join(vals)
                checked += 1
                # The daemon holds 64 one-MiB slots; 8 threads putting 360 chunks would
                # evict a slow thread's chunks before it reads them (seen as 2 of 3).
                for k in ks:
                    c.delete(k)
            return checked

        with ThreadPoolExecutor(8) as pool:
            assert sum(pool.map(work, range(8))) == 8 * 15


def test_an_http_put_prefix_keeps_a_long_sequence_head_on_a_full_daemon(
    daemon_factory: DaemonFactory,
) -> None:
    """As the same-host test (tests/service/test_shm.py), over HTTP: a daemon of four
    1 MiB slots without its same-host channel, a 12-chunk sequence put two chunks per
    request. With each request naming the chunks before it (the batch body's PREFIX),
    the head stays; without, the tail evicts it. A single put_many split into bodies
    by the client names its own earlier bodies the same way."""
    d = daemon_factory(
        "--set",
        "service.socket=",
        "--set",
        "tiers.0.capacity_bytes=4MiB",
        "--set",
        "store.placement=keep",
    )
    rng = np.random.default_rng(5)
    with Client(d.url) as c:
        assert c.same_host_socket is None
        for way in ("none", "prefix", "split"):
            seq = [os.urandom(16) for _ in range(12)]
            values = [rng.integers(0, 256, MiB, dtype=np.uint8).tobytes() for _ in seq]
            if way == "split":
                c.batch_keys = 2
                c.put_many(seq, values)
                c.batch_keys = 1024
            else:
                for i in range(0, 12, 2):
                    c.put_many(
                        seq[i : i + 2], values[i : i + 2], prefix=seq[:i] if way == "prefix" else ()
                    )
            hit = c.lookup(seq)
            if way == "none":
                assert hit.hits == 0  # each request evicted the oldest: the head
            else:
                assert hit.hits == 4, way  # the head, the whole store
                out = bytearray(4 * MiB)
                assert c.get_into(seq, out).chunks == 4
                assert bytes(out) == b"".join(values[:4])
            for k in seq:
                c.delete(k)
        assert c.prefix_keys == 1024  # read once from the daemon's limits
        # A prefix over the daemon's limit is refused naming it; nothing is stored.
        body = wire.pack_head([os.urandom(16)], [1], [os.urandom(16)] * 1025) + b"v"
        r = httpx.post(f"{d.url}/v1/batch/put", content=body)
        assert r.status_code == 400 and "limit is 1024" in r.json()["message"]


def test_a_client_sends_no_prefix_to_a_daemon_that_takes_none() -> None:
    """A daemon without ``limits.max_prefix_keys`` (older than the PREFIX flag) would
    refuse the flag: the client reads the limits and puts without it."""
    seen: list[bytes] = []

    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/stats":
            limits = {"max_value_bytes": MiB, "max_body_bytes": 64 * MiB, "max_batch_keys": 64}
            return httpx.Response(200, json={"limits": limits})
        body = request.read()
        seen.append(body)
        flags = int.from_bytes(body[6:8], "little")
        assert not flags & wire.FLAG_PREFIX
        return httpx.Response(200, json={"stored": 2, "present": 0, "rejected": 0, "failed": 0})

    with Client("http://192.0.2.1:1", transport=httpx.MockTransport(handler)) as c:
        res = c.put_many([os.urandom(16), os.urandom(16)], [b"a", b"b"], prefix=[os.urandom(16)])
    assert res.stored == 2 and len(seen) == 1 and c.prefix_keys == 0


def test_a_key_given_in_any_form_is_the_same_sixteen_bytes() -> None:
    from kvtier.service.protocol import raw_key

    raw = bytes(range(16))
    forms = [raw, bytearray(raw), memoryview(raw), raw.hex(), raw.hex().upper()]
    assert {raw_key(k) for k in forms} == {raw}
    for bad in (raw[:15], raw + b"\0", "zz" * 16, bytearray(17)):
        with pytest.raises(InputError):
            raw_key(bad)
