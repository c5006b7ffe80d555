"""Python clients of the kvtier daemon, sync and async.

Both run the operations of :mod:`kvtier.service.protocol` and take the same paths: for
an ``http://`` URL, requests go through :class:`~kvtier.service.transport.RawHTTP`
(HTTP/1.1 on plain sockets: far less client CPU per request than httpx's models);
with a loopback URL, values go through the daemon's same-host channel (shared memory,
:mod:`kvtier.service.shm_client`) while the daemon offers it; with a transport of the
caller's (``httpx.MockTransport`` in tests, or an ``https://`` URL), through httpx. They
only differ in how a blocking step runs: :class:`Client` runs it on the calling thread,
:class:`AsyncClient` on a thread of its own pool, awaited. What to send, which path to
take and when to fall back is decided once, in code both share (:class:`_Plan`,
:class:`_SameHostSwitch`). Use one client per process (or per event loop) and share it
between threads or tasks: it keeps a pool of connections.

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
import ipaddress
import json
import logging
import ssl
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Callable, Generator, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from enum import Enum
from typing import Any, Final, Generic, Literal, TypeVar

import httpx
import numpy as np
import numpy.typing as npt
from typing_extensions import override

from kvtier.errors import ConfigError, InputError, TransportError
from kvtier.store.types import LookupResult, PutResult

from . import protocol as p
from . import wire
from .protocol import Call, Fetched, KeyLike, Op, Reply, RetryPolicy
from .routes import table as routes
from .shm_client import SameHost, SameHostDown
from .transport import HTTP11Transport, RawHTTP

T = TypeVar("T")
# The httpx transport a client takes: blocking for Client, asyncio for AsyncClient.
TransportT = TypeVar("TransportT", httpx.BaseTransport, httpx.AsyncBaseTransport)
log = logging.getLogger(__name__)
SAME_HOST_HOLD_S = 1.0
"""After the same-host channel fails, HTTP only for this long before trying it again."""

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


def _parsed(status: int, body: bytes, content_type: str) -> Reply:
    parsed: Any = None
    if content_type.startswith("application/json") and body:
        try:
            parsed = json.loads(body)
        except ValueError:
            parsed = None
    return Reply(status, body, parsed)


class _AsyncParts:
    """Body pieces for httpx.AsyncClient, iterable again on a retry."""

    def __init__(self, parts: list[memoryview]) -> None:
        self.parts = parts

    async def __aiter__(self) -> AsyncIterator[bytes]:
        for part in self.parts:
            yield part  # type: ignore[misc]  # httpx sends any bytes-like piece


class _Base(ABC, Generic[TransportT]):
    """Settings, request building, the raw transport and the same-host switch shared by
    both clients.

    Args:
        url: the daemon's base URL.
        token: bearer token of a tenant; None when the daemon runs without tokens.
        timeout_s: read/write timeout of one request, in seconds.
        connect_timeout_s: connect timeout, in seconds.
        retry: retries of idempotent calls on connection errors and 429/502/503/504.
        batch_keys: most keys per batch request (the daemon's service.max_batch_keys).
        max_body_bytes: most bytes per batch-put body (the daemon's service.max_body_bytes).
        prefix_keys: most prefix keys one batch put names (the daemon's
            ``limits.max_prefix_keys``); None: read from ``/v1/stats`` when first needed.
        pool: connections kept open (size it to the number of threads or tasks).
        transport: an httpx transport (tests: ``httpx.MockTransport``); with one, every
            request goes through httpx and the same-host channel is off.
        same_host: use the same-host channel when the URL is loopback and the daemon
            offers one (False: HTTP only).
        ca_file: PEM file of the certificate authorities an ``https://`` daemon's
            certificate is verified against (a daemon with a self-signed certificate:
            that certificate); None: the system's. The certificate is always verified.
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
        prefix_keys: int | None = None,
        pool: int = 64,
        transport: TransportT | None = None,
        same_host: bool = True,
        ca_file: str | None = None,
    ) -> None:
        if batch_keys < 1:
            raise InputError(f"batch_keys must be >= 1, got {batch_keys}")
        try:
            scheme = httpx.URL(url).scheme
        except httpx.InvalidURL as exc:
            raise ConfigError("url", url, f"an http:// or https:// URL ({exc})") from None
        if scheme not in ("http", "https"):
            raise ConfigError("url", url, "an http:// or https:// URL")
        self.url = url.rstrip("/")
        self.retry = retry or RetryPolicy()
        self.batch_keys = batch_keys
        self.max_body_bytes = max_body_bytes
        self.prefix_keys = prefix_keys
        self._headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._timeout = httpx.Timeout(timeout_s, connect=connect_timeout_s)
        # https:// goes through httpx, which verifies the daemon's certificate with this.
        self._verify: ssl.SSLContext | bool = True
        if ca_file:
            try:
                self._verify = ssl.create_default_context(cafile=ca_file)
            except (OSError, ssl.SSLError) as exc:
                raise ConfigError("ca_file", ca_file, f"a readable PEM file ({exc})") from None
        self._limits = httpx.Limits(max_connections=pool, max_keepalive_connections=pool)
        self._auth_line = b"".join(
            f"{k}: {v}\r\n".encode("latin-1") for k, v in self._headers.items()
        )
        # For http:// without a transport of the caller's, requests skip httpx's models:
        # RawHTTP builds one head and parses one (a fraction of httpx's CPU per request).
        self._raw: RawHTTP | None = None
        if transport is None and self.url.startswith("http://"):
            self._raw = RawHTTP(
                self.url,
                pool=pool or 64,
                connect_timeout_s=connect_timeout_s,
                timeout_s=timeout_s,
            )
        self._switch = _SameHostSwitch(
            same_host and transport is None and is_loopback(self.url), token, timeout_s
        )
        self._open(transport)

    @property
    def _shm(self) -> SameHost | None:
        """The same-host channel open now, without connecting one (tests look at it)."""
        return self._switch.shm

    @abstractmethod
    def _open(self, transport: TransportT | None) -> None:
        """Make the httpx client (``self._http``) over ``transport``."""

    def _send_raw(self, raw: RawHTTP, call: Call) -> Reply:
        """One attempt of ``call`` through the raw transport. Blocking."""
        head = self._auth_line
        body: list[memoryview] = []
        if call.json is not None:
            body = [memoryview(json.dumps(call.json).encode())]
            head += b"Content-Type: application/json\r\n"
        elif call.content is not None:
            parts = call.content if isinstance(call.content, list) else [call.content]
            body = [memoryview(x) for x in parts]
            head += _OCTET_LINE
        status, headers, data = raw.request(call.method, call.path, head, body, call.sink)
        if call.sink is not None and status == 200:
            return Reply(200, b"")
        return _parsed(status, data, headers.get("content-type", ""))

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
    def _reply(r: httpx.Response) -> Reply:
        return _parsed(r.status_code, r.content, r.headers.get("content-type", ""))

    @staticmethod
    def _translate(exc: httpx.HTTPError, call: Call) -> TransportError:
        what = "timed out" if isinstance(exc, httpx.TimeoutException) else "failed"
        return TransportError(f"{call.method} {call.path} {what}: {type(exc).__name__}: {exc}")

    def _delays(self, call: Call) -> Iterator[float]:
        """Waits before each retry; none for a call that must not be repeated."""
        return self.retry.delays() if call.idempotent else iter(())

    @staticmethod
    def _retry_step(
        call: Call, delays: Iterator[float], outcome: Reply | TransportError
    ) -> Reply | float:
        """What follows one attempt: the reply to return, or the wait in seconds before the next.

        Retries a transport error or a retryable status while ``delays`` lasts; then the last
        reply stands, or the last error is raised.
        """
        if isinstance(outcome, Reply) and outcome.status not in p.RETRY_STATUSES:
            return outcome
        delay = next(delays, None)
        if delay is None:
            if isinstance(outcome, TransportError):
                raise outcome
            return outcome
        if call.sink is not None:
            call.sink.reset()
        return delay

    # -- the API, decided once for both clients: each a plan (same-host step, HTTP op) ----

    def _plan_put_many(
        self,
        keys: Sequence[KeyLike],
        values: Sequence[bytes | bytearray | memoryview],
        prefix: Sequence[KeyLike],
    ) -> _Plan[PutResult]:
        http: Op[PutResult] = (
            p.op_put(keys[0], values[0])
            if len(keys) == 1 and len(values) == 1 and not prefix
            else self._put_many(keys, values, prefix)
        )
        raw_keys, raw_prefix = [p.raw_key(k) for k in keys], [p.raw_key(k) for k in prefix]
        return _Plan(lambda shm: shm.put(raw_keys, values, raw_prefix), http)

    @staticmethod
    def _plan_get(key: KeyLike) -> _Plan[bytes | None]:
        def over_shm(shm: SameHost) -> bytes | None:
            buf = np.empty(shm.info.max_value_bytes, dtype=np.uint8)  # pages untouched
            got = shm.get_into([p.raw_key(key)], buf.data)
            return buf[: got.nbytes].tobytes() if got.chunks else None

        return _Plan(over_shm, p.op_get(key))

    @staticmethod
    def _plan_exists(key: KeyLike) -> _Plan[bool]:
        raw = p.raw_key(key)
        return _Plan(lambda shm: shm.lookup([raw]).hits == 1, p.op_exists(key))

    @staticmethod
    def _plan_delete(key: KeyLike) -> _Plan[bool]:
        raw = p.raw_key(key)
        return _Plan(lambda shm: shm.delete([raw]) > 0, p.op_delete(key))

    def _plan_lookup(self, keys: Sequence[KeyLike]) -> _Plan[LookupResult]:
        raw = [p.raw_key(k) for k in keys]
        return _Plan(lambda shm: shm.lookup(raw), self._lookup(keys))

    def _plan_get_into(self, keys: Sequence[KeyLike], buffer: Buffer) -> _Plan[Fetched]:
        dst = _writable(buffer)
        raw = [p.raw_key(k) for k in keys]
        return _Plan(lambda shm: shm.get_into(raw, dst), p.op_get_into(keys, dst, self.batch_keys))

    # Batch operations need the client's limits; single ones do not.
    def _lookup(self, keys: Sequence[KeyLike]) -> Op[LookupResult]:
        return p.op_lookup(keys, self.batch_keys)

    def _put_many(
        self, keys: Sequence[KeyLike], values: Sequence[Any], prefix: Sequence[KeyLike] = ()
    ) -> Op[PutResult]:
        if self.prefix_keys is None and (prefix or len(keys) > 1):
            # Once per client; a failure here (daemon down, bad token) is the put's own.
            limits = (yield from p.op_stats())["limits"]
            self.prefix_keys = int(limits.get("max_prefix_keys", 0))
        return (
            yield from p.op_put_many(
                keys, values, self.batch_keys, self.max_body_bytes, prefix, self.prefix_keys or 0
            )
        )


def is_loopback(url: str) -> bool:
    """True when ``url`` names this machine by a loopback address or ``localhost``."""
    host = httpx.URL(url).host
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _op_same_host() -> Op[str | None]:
    reply = yield p.call(routes.SAME_HOST)
    if reply.status == 404:  # a daemon from before the same-host channel
        return None
    p.check(reply)
    path = reply.json.get("socket") if isinstance(reply.json, dict) else None
    return str(path) if path else None


@dataclass(frozen=True, slots=True)
class _Plan(Generic[T]):
    """One API call, decided once for both clients: what to do over the same-host
    channel (None: HTTP only), and the HTTP operation that serves it otherwise."""

    shm: Callable[[SameHost], T] | None
    http: Op[T]


class _Due(Enum):
    CONNECT = "connect"


_CONNECT: Final = _Due.CONNECT


class _SameHostSwitch:
    """Whether values go through the same-host channel now, for either client.

    The client asks :meth:`due`; on :data:`_CONNECT` it fetches the daemon's socket path
    over HTTP (its own way: blocking or awaited) and reports it to :meth:`connect`, or
    reports the failure to :meth:`unusable`. A channel that fails under a call goes to
    :meth:`failed`; HTTP then serves for :data:`SAME_HOST_HOLD_S` before the next try.
    Thread-safe.
    """

    def __init__(self, wanted: bool, token: str | None, timeout_s: float) -> None:
        self.wanted = wanted
        self.shm: SameHost | None = None
        self.lock = threading.Lock()  # guards shm; held briefly
        self.connecting = threading.Lock()  # one connect at a time (Client's threads)
        self._token = token
        self._timeout_s = timeout_s
        self._retry_at = 0.0

    def due(self) -> SameHost | Literal[_Due.CONNECT] | None:
        """The channel; None: use HTTP; :data:`_CONNECT`: connect it first."""
        if not self.wanted:
            return None
        shm = self.shm
        if shm is not None or time.monotonic() < self._retry_at:
            return shm
        return _CONNECT

    def current(self) -> SameHost | None:
        """The channel as it is now; None: use HTTP."""
        return self.shm if self.wanted else None

    def connect(self, url: str, path: str | None) -> None:
        """Open the channel at ``path`` (None: the daemon has none). Blocking (a Unix
        socket's connect and HELLO).

        Raises:
            SameHostDown, OSError: the channel cannot be opened.
        """
        if path is None:
            self.wanted = False  # the daemon has none: HTTP for good
            log.info("kvtier daemon %s offers no same-host socket; using HTTP", url)
            return
        shm = SameHost(path, self._token, self._timeout_s)
        with self.lock:
            old, self.shm = self.shm, shm
        if old is not None:
            old.close()
        log.info("kvtier daemon %s: values through shared memory (%s)", url, path)

    def unusable(self, exc: Exception) -> None:
        self._retry_at = time.monotonic() + SAME_HOST_HOLD_S
        log.warning("kvtier same-host channel unusable, using HTTP: %s", exc)

    def failed(self, shm: SameHost, exc: Exception) -> None:
        with self.lock:
            if self.shm is shm:
                self.shm = None
                self._retry_at = time.monotonic() + SAME_HOST_HOLD_S
                log.warning("kvtier same-host channel failed, using HTTP: %s", exc)
        shm.close()

    def close(self) -> None:
        if self.shm is not None:
            self.shm.close()


def shared_buffer(shm: SameHost | None, nbytes: int) -> npt.NDArray[np.uint8]:
    """A uint8 buffer of ``nbytes``, in ``shm``'s shared memory when it can be."""
    if shm is not None:
        try:
            return shm.shared_buffer(nbytes)
        except OSError as exc:
            log.warning("kvtier shared buffer of %d B unavailable: %s", nbytes, exc)
    return np.empty(nbytes, dtype=np.uint8)


def shared_region(shm: SameHost | None, nbytes: int) -> npt.NDArray[np.uint8] | None:
    """A buffer in ``shm``'s shared memory of ``nbytes`` or the largest region the
    daemon maps; None without a channel or when the memory cannot be made."""
    if shm is None:
        return None
    size = min(nbytes, shm.info.max_region_bytes)
    if size <= 0:
        return None
    try:
        return shm.shared_buffer(size)
    except OSError as exc:
        log.warning("kvtier shared region of %d B unavailable: %s", size, exc)
        return None


class Client(_Base[httpx.BaseTransport]):
    """Blocking client. Thread-safe: share one between threads.

    For ``http://`` URLs it sends through :class:`~kvtier.service.transport.RawHTTP`.
    Pass a transport (e.g. ``httpx.HTTPTransport()``) to send through httpx instead.

    With a loopback URL, values go through shared memory when the daemon offers its
    same-host channel (``same_host=False`` forces HTTP). A channel that fails is logged
    and HTTP serves until it works again. Buffers from :meth:`shared_buffer` then move
    no byte on this side.
    """

    _http: httpx.Client

    @override
    def _open(self, transport: httpx.BaseTransport | None) -> None:
        if transport is None and self._raw is not None:
            transport = HTTP11Transport(
                pool=1,  # unused while RawHTTP sends
                connect_timeout_s=self._timeout.connect or 2.0,
                timeout_s=self._timeout.read or 30.0,
            )
        self._http = httpx.Client(
            base_url=self.url,
            timeout=self._timeout,
            limits=self._limits,
            transport=transport,
            verify=self._verify,
        )

    def _send(self, call: Call) -> Reply:
        delays = self._delays(call)
        while True:
            try:
                outcome: Reply | TransportError = self._send_once(call)
            except httpx.HTTPError as exc:
                outcome = self._translate(exc, call)
            step = self._retry_step(call, delays, outcome)
            if isinstance(step, Reply):
                return step
            time.sleep(step)

    def _send_once(self, call: Call) -> Reply:
        if self._raw is not None:
            return self._send_raw(self._raw, call)
        kw = self._request_kwargs(call)
        if call.sink is None:
            r = self._http.request(call.method, call.path, **kw)
            return self._reply(r)
        with self._http.stream(call.method, call.path, **kw) as r:
            if r.status_code != 200:
                r.read()
                return self._reply(r)
            for piece in r.iter_raw():
                call.sink.feed(piece)
            return Reply(200, b"")

    def _run(self, op: Generator[Call, Reply, T]) -> T:
        try:
            call = next(op)
            while True:
                call = op.send(self._send(call))
        except StopIteration as stop:
            result: T = stop.value
            return result

    def _same_host(self) -> SameHost | None:
        """The channel, connecting it when due; None: use HTTP."""
        sw = self._switch
        if sw.due() is _CONNECT:
            with sw.connecting:  # one connect at a time; the others wait for it
                if sw.due() is _CONNECT:
                    try:
                        sw.connect(self.url, self._run(_op_same_host()))
                    except (SameHostDown, TransportError, OSError) as exc:
                        sw.unusable(exc)
        return sw.current()

    def _do(self, plan: _Plan[T]) -> T:
        """``plan`` over the same-host channel while it is up; else, or when the channel
        fails under it, over HTTP (the channel is closed and retried later)."""
        if plan.shm is not None:
            shm = self._same_host()
            if shm is not None:
                try:
                    return plan.shm(shm)
                except SameHostDown as exc:
                    self._switch.failed(shm, exc)
        return self._run(plan.http)

    # -- the same-host channel ------------------------------------------------------------------

    @property
    def same_host_socket(self) -> str | None:
        """The daemon socket values go through now; None while they go through HTTP."""
        shm = self._same_host()
        return shm.path if shm is not None else None

    def shared_buffer(self, nbytes: int) -> npt.NDArray[np.uint8]:
        """A uint8 buffer of ``nbytes``; in shared memory when the same-host channel is
        up, so puts from it and gets into it copy nothing on this side. Keep it while the
        client lives."""
        return shared_buffer(self._same_host(), nbytes)

    def shared_region(self, nbytes: int) -> npt.NDArray[np.uint8] | None:
        """A uint8 buffer in memory shared with the daemon, of ``nbytes`` or the largest
        region the daemon maps if that is less; None while the same-host channel is down
        or the memory cannot be made. Gets into it copy nothing on this side while
        :meth:`is_shared` says so (a new channel after a failure does not know it)."""
        return shared_region(self._same_host(), nbytes)

    def is_shared(self, buffer: Buffer) -> bool:
        """True while ``buffer`` lies in memory the current same-host channel shares
        with the daemon."""
        shm = self._same_host()
        return shm is not None and shm.holds(_writable(buffer))

    # -- the API (each line runs one shared plan or operation) ---------------------------

    def put(self, key: KeyLike, value: bytes | bytearray | memoryview) -> PutResult:
        """Store one value (keys are write-once: a present key reports ``present``)."""
        return self.put_many([key], [value])

    def get(self, key: KeyLike) -> bytes | None:
        """One value, or None when the key is not present."""
        return self._do(self._plan_get(key))

    def exists(self, key: KeyLike) -> bool:
        return self._do(self._plan_exists(key))

    def delete(self, key: KeyLike) -> bool:
        """Remove a key; True when it was present."""
        return self._do(self._plan_delete(key))

    def lookup(self, keys: Sequence[KeyLike]) -> LookupResult:
        """Length of the leading run of present keys, and the tier of each hit."""
        return self._do(self._plan_lookup(keys))

    def put_many(
        self,
        keys: Sequence[KeyLike],
        values: Sequence[bytes | bytearray | memoryview],
        *,
        prefix: Sequence[KeyLike] = (),
    ) -> PutResult:
        """Store values in as few batch requests as the limits allow.

        ``prefix``: keys of the sequence's chunks before ``keys``, which the daemon keeps
        from eviction while it makes room for these (a sequence longer than the store
        then keeps its head). Over HTTP, a daemon older than the PREFIX flag of the
        batch format (``limits.max_prefix_keys`` absent) gets none.
        """
        return self._do(self._plan_put_many(keys, values, prefix))

    def get_many(self, keys: Sequence[KeyLike]) -> list[bytes]:
        """The values of the leading run of present keys."""
        return self._run(p.op_get_many(keys, self.batch_keys))

    def get_into(self, keys: Sequence[KeyLike], buffer: Buffer) -> Fetched:
        """Copy the leading run of present values into ``buffer``, packed, as they arrive.

        The one copy is from the socket's pieces (or, same-host, the daemon's tier) into
        ``buffer``; values that do not fit whole end the run. Use a numpy array,
        bytearray or any writable buffer.
        """
        return self._do(self._plan_get_into(keys, buffer))

    def stats(self) -> dict[str, Any]:
        return self._run(p.op_stats())

    def ready(self) -> bool:
        """True when the daemon answers /readyz with 200 (False when it cannot be reached)."""
        try:
            return self._run(p.op_ready())
        except TransportError:
            return False

    def close(self) -> None:
        self._switch.close()
        if self._raw is not None:
            self._raw.close()
        self._http.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class AsyncClient(_Base[httpx.AsyncBaseTransport]):
    """asyncio client, at parity with :class:`Client`: the same raw transport and the
    same same-host channel, their blocking steps run on a pool of ``pool`` threads and
    awaited. Use from one event loop; concurrent tasks share its connections.
    """

    _http: httpx.AsyncClient

    @override
    def _open(self, transport: httpx.AsyncBaseTransport | None) -> None:
        self._http = httpx.AsyncClient(
            base_url=self.url,
            timeout=self._timeout,
            limits=self._limits,
            transport=transport,
            verify=self._verify,
        )
        self._threads: ThreadPoolExecutor | None = None
        self._connecting: asyncio.Lock | None = None

    async def _blocking(self, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` on the client's threads (one per pooled connection), awaited."""
        if self._threads is None:
            n = self._limits.max_keepalive_connections or 64
            self._threads = ThreadPoolExecutor(n, thread_name_prefix="kvtier-client")
        return await asyncio.get_running_loop().run_in_executor(self._threads, fn, *args)

    async def _send(self, call: Call) -> Reply:
        delays = self._delays(call)
        while True:
            try:
                outcome: Reply | TransportError = await self._send_once(call)
            except httpx.HTTPError as exc:
                outcome = self._translate(exc, call)
            step = self._retry_step(call, delays, outcome)
            if isinstance(step, Reply):
                return step
            await asyncio.sleep(step)

    async def _send_once(self, call: Call) -> Reply:
        if self._raw is not None:
            return await self._blocking(self._send_raw, self._raw, call)
        kw = self._request_kwargs(call, asynchronous=True)
        if call.sink is None:
            r = await self._http.request(call.method, call.path, **kw)
            return self._reply(r)
        async with self._http.stream(call.method, call.path, **kw) as r:
            if r.status_code != 200:
                await r.aread()
                return self._reply(r)
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

    async def _same_host(self) -> SameHost | None:
        """The channel, connecting it when due; None: use HTTP."""
        sw = self._switch
        if sw.due() is not _CONNECT:
            return sw.current()
        if self._connecting is None:
            self._connecting = asyncio.Lock()
        async with self._connecting:  # one connect at a time; the others wait for it
            if sw.due() is _CONNECT:
                try:
                    path = await self._run(_op_same_host())
                    await self._blocking(sw.connect, self.url, path)
                except (SameHostDown, TransportError, OSError) as exc:
                    sw.unusable(exc)
        return sw.current()

    async def _do(self, plan: _Plan[T]) -> T:
        """As :meth:`Client._do`: the same-host step on the client's threads."""
        if plan.shm is not None:
            shm = await self._same_host()
            if shm is not None:
                try:
                    return await self._blocking(plan.shm, shm)
                except SameHostDown as exc:
                    self._switch.failed(shm, exc)
        return await self._run(plan.http)

    # -- the same-host channel (as Client's) ------------------------------------------------

    async def same_host_socket(self) -> str | None:
        shm = await self._same_host()
        return shm.path if shm is not None else None

    async def shared_buffer(self, nbytes: int) -> npt.NDArray[np.uint8]:
        return shared_buffer(await self._same_host(), nbytes)

    async def shared_region(self, nbytes: int) -> npt.NDArray[np.uint8] | None:
        return shared_region(await self._same_host(), nbytes)

    async def is_shared(self, buffer: Buffer) -> bool:
        shm = await self._same_host()
        return shm is not None and shm.holds(_writable(buffer))

    # -- the API (as Client's) --------------------------------------------------------------

    async def put(self, key: KeyLike, value: bytes | bytearray | memoryview) -> PutResult:
        return await self.put_many([key], [value])

    async def get(self, key: KeyLike) -> bytes | None:
        return await self._do(self._plan_get(key))

    async def exists(self, key: KeyLike) -> bool:
        return await self._do(self._plan_exists(key))

    async def delete(self, key: KeyLike) -> bool:
        return await self._do(self._plan_delete(key))

    async def lookup(self, keys: Sequence[KeyLike]) -> LookupResult:
        return await self._do(self._plan_lookup(keys))

    async def put_many(
        self,
        keys: Sequence[KeyLike],
        values: Sequence[bytes | bytearray | memoryview],
        *,
        prefix: Sequence[KeyLike] = (),
    ) -> PutResult:
        """As :meth:`Client.put_many`."""
        return await self._do(self._plan_put_many(keys, values, prefix))

    async def get_many(self, keys: Sequence[KeyLike]) -> list[bytes]:
        return await self._run(p.op_get_many(keys, self.batch_keys))

    async def get_into(self, keys: Sequence[KeyLike], buffer: Buffer) -> Fetched:
        return await self._do(self._plan_get_into(keys, buffer))

    async def stats(self) -> dict[str, Any]:
        return await self._run(p.op_stats())

    async def ready(self) -> bool:
        try:
            return await self._run(p.op_ready())
        except TransportError:
            return False

    async def aclose(self) -> None:
        threads, self._threads = self._threads, None
        if threads is not None:
            threads.shutdown(wait=True)  # its calls are done: their awaiters are gone
        self._switch.close()
        if self._raw is not None:
            self._raw.close()
        await self._http.aclose()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()
