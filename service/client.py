"""Python clients of the kvtier daemon, sync and async, on httpx.

Both run the operations of :mod:`kvtier.service.protocol`; they only differ in how a
request is sent and how they sleep between retries. Use one client per process (or
per event loop) and share it between threads: it keeps a pool of connections.

    >>> with Client("http://127.0.0.1:8470", token=None) as c:
    ...     c.put(key, value)
    ...     c.lookup([key]).hits
    ...     n = c.get_into([key], buffer).nbytes

Errors (see :mod:`kvtier.service.protocol`): :class:`~kvtier.errors.TransportError`
when the daemon cannot be reached or fails after the retries,
:class:`~kvtier.errors.AuthError` for a refused token, and
:class:`~kvtier.errors.InputError` for a request the daemon refused. A missing key is
never an error: ``get`` returns None, lookups count misses.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Generator, Sequence
from typing import Any, TypeVar

import httpx
import numpy as np
import numpy.typing as npt

from kvtier.errors import InputError, TransportError
from kvtier.store.types import LookupResult, PutResult

from . import protocol as p
from . import wire
from .protocol import Call, Fetched, KeyLike, Op, Reply, RetryPolicy
from .transport import HTTP11Transport, RawHTTP

T = TypeVar("T")

DEFAULT_URL = "http://127.0.0.1:8470"
_OCTET_LINE = f"Content-Type: {wire.MEDIA_TYPE}\r\n".encode("ascii")
Buffer = memoryview | bytearray | npt.NDArray[Any]


def _writable(buf: Buffer) -> memoryview:
    if isinstance(buf, np.ndarray):
        if not buf.flags.c_contiguous:
            raise InputError("buffer must be C-contiguous")
        buf = buf.reshape(-1).view(np.uint8).data
    view = memoryview(buf)
    view = view.cast("B") if view.format != "B" or view.ndim != 1 else view
    if view.readonly:
        raise InputError("destination buffer is read-only")
    return view


class _AsyncParts:
    """Body pieces for httpx.AsyncClient, iterable again on a retry."""

    def __init__(self, parts: list[memoryview]) -> None:
        self.parts = parts

    async def __aiter__(self) -> AsyncIterator[bytes]:
        for part in self.parts:
            yield part  # type: ignore[misc]  # httpx sends any bytes-like piece


class _Base:
    """Settings and request building shared by both clients.

    Args:
        url: the daemon's base URL.
        token: bearer token of a tenant; None when the daemon runs without tokens.
        timeout_s: read/write timeout of one request, in seconds.
        connect_timeout_s: connect timeout, in seconds.
        retry: retries of idempotent calls on connection errors and 429/502/503/504.
        batch_keys: most keys per batch request (the daemon's service.max_batch_keys).
        max_body_bytes: most bytes per batch-put body (the daemon's service.max_body_bytes).
        pool: connections kept open (size it to the number of threads or tasks).
        transport: an httpx transport (tests: ``httpx.MockTransport``).
    """

    def __init__(
        self,
        url: str = DEFAULT_URL,
        token: str | None = None,
        *,
        timeout_s: float = 30.0,
        connect_timeout_s: float = 2.0,
        retry: RetryPolicy | None = None,
        batch_keys: int = 1024,
        max_body_bytes: int = 256 * 1024 * 1024,
        pool: int = 64,
    ) -> None:
        if batch_keys < 1:
            raise InputError(f"batch_keys must be >= 1, got {batch_keys}")
        self.url = url.rstrip("/")
        self.retry = retry or RetryPolicy()
        self.batch_keys = batch_keys
        self.max_body_bytes = max_body_bytes
        self._headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._timeout = httpx.Timeout(timeout_s, connect=connect_timeout_s)
        self._limits = httpx.Limits(max_connections=pool, max_keepalive_connections=pool)

    def _request_kwargs(self, call: Call, *, asynchronous: bool = False) -> dict[str, Any]:
        kw: dict[str, Any] = {"headers": self._headers}
        if call.json is not None:
            kw["content"] = json.dumps(call.json).encode()
            kw["headers"] = {**self._headers, "Content-Type": "application/json"}
        elif call.content is not None:
            # Pieces go out one after the other under one Content-Length: no joined copy.
            parts = call.content if isinstance(call.content, list) else [call.content]
            views = [memoryview(x).cast("B") for x in parts]
            kw["content"] = _AsyncParts(views) if asynchronous else views
            kw["headers"] = {
                **self._headers,
                "Content-Type": wire.MEDIA_TYPE,
                "Content-Length": str(sum(v.nbytes for v in views)),
            }
        return kw

    @staticmethod
    def _reply(status: int, body: bytes, content_type: str) -> Reply:
        parsed: Any = None
        if content_type.startswith("application/json") and body:
            try:
                parsed = json.loads(body)
            except ValueError:
                parsed = None
        return Reply(status, body, parsed)

    @staticmethod
    def _translate(exc: httpx.HTTPError, call: Call) -> TransportError:
        what = "timed out" if isinstance(exc, httpx.TimeoutException) else "failed"
        return TransportError(f"{call.method} {call.path} {what}: {type(exc).__name__}: {exc}")

    # Batch operations need the client's limits; single ones do not.
    def _lookup(self, keys: Sequence[KeyLike]) -> Op[LookupResult]:
        return p.op_lookup(keys, self.batch_keys)

    def _put_many(self, keys: Sequence[KeyLike], values: Sequence[Any]) -> Op[PutResult]:
        return p.op_put_many(keys, values, self.batch_keys, self.max_body_bytes)


class Client(_Base):
    """Blocking client. Thread-safe: share one between threads.

    For ``http://`` URLs it sends through :class:`~kvtier.service.transport.HTTP11Transport`
    (httpx's API over ``http.client``; a third of httpcore's CPU per request). Pass
    ``transport=httpx.HTTPTransport()`` for httpx's own.
    """

    def __init__(
        self,
        url: str = DEFAULT_URL,
        token: str | None = None,
        *,
        transport: httpx.BaseTransport | None = None,
        **kw: Any,
    ) -> None:
        super().__init__(url, token, **kw)
        # For http:// without a transport of the caller's, requests skip httpx's models:
        # RawHTTP builds one head and parses one (a fraction of httpx's CPU per request).
        self._raw: RawHTTP | None = None
        if transport is None and self.url.startswith("http://"):
            self._raw = RawHTTP(
                self.url,
                pool=self._limits.max_keepalive_connections or 64,
                connect_timeout_s=self._timeout.connect or 2.0,
                timeout_s=self._timeout.read or 30.0,
            )
            transport = HTTP11Transport(
                pool=1,
                connect_timeout_s=self._timeout.connect or 2.0,
                timeout_s=self._timeout.read or 30.0,
            )
        self._auth_line = b"".join(
            f"{k}: {v}\r\n".encode("latin-1") for k, v in self._headers.items()
        )
        self._http = httpx.Client(
            base_url=self.url, timeout=self._timeout, limits=self._limits, transport=transport
        )

    def _send(self, call: Call) -> Reply:
        delays = self.retry.delays() if call.idempotent else iter(())
        while True:
            try:
                reply = self._send_once(call)
            except httpx.HTTPError as exc:
                err: TransportError | None = self._translate(exc, call)
            else:
                if reply.status not in p.RETRY_STATUSES:
                    return reply
                err = None
            delay = next(delays, None)
            if delay is None:
                if err is not None:
                    raise err
                return reply
            if call.sink is not None:
                call.sink.reset()
            time.sleep(delay)

    def _send_once(self, call: Call) -> Reply:
        if self._raw is not None:
            return self._send_raw(self._raw, call)
        kw = self._request_kwargs(call)
        if call.sink is None:
            r = self._http.request(call.method, call.path, **kw)
            return self._reply(r.status_code, r.content, r.headers.get("content-type", ""))
        with self._http.stream(call.method, call.path, **kw) as r:
            if r.status_code != 200:
                r.read()
                return self._reply(r.status_code, r.content, r.headers.get("content-type", ""))
            for piece in r.iter_raw():
                call.sink.feed(piece)
            return Reply(200, b"")

    def _send_raw(self, raw: RawHTTP, call: Call) -> Reply:
        head = self._auth_line
        body: list[memoryview] = []
        if call.json is not None:
            body = [memoryview(json.dumps(call.json).encode())]
            head += b"Content-Type: application/json\r\n"
        elif call.content is not None:
            parts = call.content if isinstance(call.content, list) else [call.content]
            body = [memoryview(x) for x in parts]
            head += _OCTET_LINE
        sink = call.sink.feed if call.sink is not None else None
        status, headers, data = raw.request(call.method, call.path, head, body, sink)
        if sink is not None and status == 200:
            return Reply(200, b"")
        return self._reply(status, data, headers.get("content-type", ""))

    def _run(self, op: Generator[Call, Reply, T]) -> T:
        try:
            call = next(op)
            while True:
                call = op.send(self._send(call))
        except StopIteration as stop:
            result: T = stop.value
            return result

    # -- the API (each line runs one shared operation) --------------------------------------

    def put(self, key: KeyLike, value: bytes | bytearray | memoryview) -> PutResult:
        """Store one value (keys are write-once: a present key reports ``present``)."""
        return self._run(p.op_put(key, value))

    def get(self, key: KeyLike) -> bytes | None:
        """One value, or None when the key is not present."""
        return self._run(p.op_get(key))

    def exists(self, key: KeyLike) -> bool:
        return self._run(p.op_exists(key))

    def delete(self, key: KeyLike) -> bool:
        """Remove a key; True when it was present."""
        return self._run(p.op_delete(key))

    def lookup(self, keys: Sequence[KeyLike]) -> LookupResult:
        """Length of the leading run of present keys, and the tier of each hit."""
        return self._run(self._lookup(keys))

    def put_many(
        self, keys: Sequence[KeyLike], values: Sequence[bytes | bytearray | memoryview]
    ) -> PutResult:
        """Store values in as few batch requests as the limits allow."""
        return self._run(self._put_many(keys, values))

    def get_many(self, keys: Sequence[KeyLike]) -> list[bytes]:
        """The values of the leading run of present keys."""
        return self._run(p.op_get_many(keys, self.batch_keys))

    def get_into(self, keys: Sequence[KeyLike], buffer: Buffer) -> Fetched:
        """Copy the leading run of present values into ``buffer``, packed, as they arrive.

        The one copy is from the socket's pieces into ``buffer``; values that do not fit
        whole end the run. Use a numpy array, bytearray or any writable buffer.
        """
        return self._run(p.op_get_into(keys, _writable(buffer), self.batch_keys))

    def stats(self) -> dict[str, Any]:
        return self._run(p.op_stats())

    def ready(self) -> bool:
        """True when the daemon answers /readyz with 200 (False when it cannot be reached)."""
        try:
            return self._run(p.op_ready())
        except TransportError:
            return False

    def close(self) -> None:
        if self._raw is not None:
            self._raw.close()
        self._http.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class AsyncClient(_Base):
    """asyncio client. Use from one event loop; concurrent tasks share its pool."""

    def __init__(
        self,
        url: str = DEFAULT_URL,
        token: str | None = None,
        *,
        transport: httpx.AsyncBaseTransport | None = None,
        **kw: Any,
    ) -> None:
        super().__init__(url, token, **kw)
        self._http = httpx.AsyncClient(
            base_url=self.url, timeout=self._timeout, limits=self._limits, transport=transport
        )

    async def _send(self, call: Call) -> Reply:
        delays = self.retry.delays() if call.idempotent else iter(())
        while True:
            try:
                reply = await self._send_once(call)
            except httpx.HTTPError as exc:
                err: TransportError | None = self._translate(exc, call)
            else:
                if reply.status not in p.RETRY_STATUSES:
                    return reply
                err = None
            delay = next(delays, None)
            if delay is None:
                if err is not None:
                    raise err
                return reply
            if call.sink is not None:
                call.sink.reset()
            await asyncio.sleep(delay)

    async def _send_once(self, call: Call) -> Reply:
        kw = self._request_kwargs(call, asynchronous=True)
        if call.sink is None:
            r = await self._http.request(call.method, call.path, **kw)
            return self._reply(r.status_code, r.content, r.headers.get("content-type", ""))
        async with self._http.stream(call.method, call.path, **kw) as r:
            if r.status_code != 200:
                await r.aread()
                return self._reply(r.status_code, r.content, r.headers.get("content-type", ""))
            async for piece in r.aiter_raw():
                call.sink.feed(piece)
            return Reply(200, b"")

    async def _run(self, op: Generator[Call, Reply, T]) -> T:
        try:
            call = next(op)
            while True:
                call = op.send(await self._send(call))
        except StopIteration as stop:
            result: T = stop.value
            return result

    async def put(self, key: KeyLike, value: bytes | bytearray | memoryview) -> PutResult:
        return await self._run(p.op_put(key, value))

    async def get(self, key: KeyLike) -> bytes | None:
        return await self._run(p.op_get(key))

    async def exists(self, key: KeyLike) -> bool:
        return await self._run(p.op_exists(key))

    async def delete(self, key: KeyLike) -> bool:
        return await self._run(p.op_delete(key))

    async def lookup(self, keys: Sequence[KeyLike]) -> LookupResult:
        return await self._run(self._lookup(keys))

    async def put_many(
        self, keys: Sequence[KeyLike], values: Sequence[bytes | bytearray | memoryview]
    ) -> PutResult:
        return await self._run(self._put_many(keys, values))

    async def get_many(self, keys: Sequence[KeyLike]) -> list[bytes]:
        return await self._run(p.op_get_many(keys, self.batch_keys))

    async def get_into(self, keys: Sequence[KeyLike], buffer: Buffer) -> Fetched:
        return await self._run(p.op_get_into(keys, _writable(buffer), self.batch_keys))

    async def stats(self) -> dict[str, Any]:
        return await self._run(p.op_stats())

    async def ready(self) -> bool:
        try:
            return await self._run(p.op_ready())
        except TransportError:
            return False

    async def aclose(self) -> None:
        await self._http.aclose()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()
