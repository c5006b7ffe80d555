"""The daemon's data-plane front end: one-chunk ``GET`` and ``PUT`` answered in its HTTP
protocol, and a bound on every request's head.

It is uvicorn's httptools protocol (the ``http`` setting, :func:`protocol_class`) with
three additions, and the one place the daemon builds on a server's internals (why, and
what it buys: docs/architecture.md, "One request core"):

* **Answers below ASGI.** When a plain keep-alive request's head is complete (HTTP/1.1,
  or HTTP/1.0 with ``Connection: keep-alive``, answered with the same) and nothing
  else is in flight on the connection, a ``GET``/``PUT /v1/chunks/{key}`` that the
  request core (:mod:`kvtier.service.core`) can serve at once is answered here, with the
  core's admission, budget, tenant counters, metrics and answer bytes, and no task,
  request cycle or ASGI layer: a hit in memory is written straight from the tier's slot
  (one ``writev``); a PUT's body pieces are copied straight into a reserved slot as the
  parser hands them over, and answered when the body ends. Everything else (a query
  string, a body on a GET, a chunked or refused request, a hit behind I/O, a full budget,
  a store that cannot reserve, a pipelined request) goes to the FastAPI app as it came,
  and its routes call the same core.
* **A bound on the head's size.** httptools accumulates a header value by concatenation,
  so a huge header costs time quadratic in its size and delays every other request
  (tests/service/test_limits.py). The protocol counts the bytes of a
  request's head *before* handing them to the parser and answers ``431`` past
  ``service.max_header_bytes``. Counting is exact up to the read that completes a head;
  a pipelined request that starts inside another's read is counted from the next read
  on, so the bound holds within one read (at most 256 KiB).
* **A bound on the head's time.** A client that takes longer than
  ``service.header_timeout_s`` to send a head (from its first byte, or from the
  connection's start) is disconnected.

uvicorn is held to one minor release in pyproject.toml for this module's sake.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import time
from typing import Any

from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol

from kvtier.errors import KVTierError
from kvtier.store.handles import HeldValue

from .core import NOT_NOW, Admitted, Answer, ChunkPut, Head, RequestCore
from .routes.table import GET_CHUNK, PUT_CHUNK, chunk_key_of_url
from .tenants import Tenant

log = logging.getLogger(__name__)

_END = b"\r\n\r\n"
_OCTET = [(b"content-type", b"application/octet-stream")]


class _NoEvent:
    def set(self) -> None:
        pass


class _Answered:
    """The connection's cycle once a direct answer is written: complete, nothing pending
    (what uvicorn reads of a finished cycle: on_body, on_message_complete, shutdown,
    connection_lost)."""

    response_complete = True
    disconnected = False
    keep_alive = True
    message_event = _NoEvent()


_ANSWERED = _Answered()


def head_end(tail: bytes, data: bytes) -> int:
    """Bytes of ``data`` that belong to a head whose previous read ended in ``tail`` (its
    last 3 bytes), or -1 when the head does not end in ``data``.

    No copy of ``data``: the first read of a PUT carries the head and up to 256 KiB of
    its body, and the end marker is found near its start.
    """
    if tail:  # the end marker may straddle two reads
        j = (tail + data[: len(_END) - 1]).find(_END)
        if j >= 0:
            return j + len(_END) - len(tail)
    j = data.find(_END)
    return j + len(_END) if j >= 0 else -1


class DataPlaneProtocol(HttpToolsProtocol):
    """uvicorn's HttpToolsProtocol answering one-chunk GETs and PUTs itself, refusing
    large heads (431) and dropping slow ones.

    Subclass per daemon through :func:`protocol_class`, which sets the limits and the core.
    """

    max_header_bytes = 32 * 1024
    header_timeout_s = 10.0
    core: RequestCore | None = None

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._in_head = True
        self._head_bytes = 0
        self._tail = b""
        self._head_timer: asyncio.TimerHandle | None = None
        self._put: tuple[ChunkPut, _Into] | None = None
        self._closing = False
        self._plain_socket = False
        # The request being answered is HTTP/1.0 asking to keep the connection: its
        # answer must say so (``connection: keep-alive``), or the client closes it.
        self._keep_alive_10 = False

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        # Whether an answer may be written straight to the socket: not under TLS, where
        # the socket carries records only the transport may write.
        self._plain_socket = transport.get_extra_info("ssl_object") is None
        self._arm()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        put, self._put = self._put, None
        if put is not None:
            put[0].abort()
        super().connection_lost(exc)

    def shutdown(self) -> None:
        if self._put is None:
            super().shutdown()
            return
        # Answer the PUT being received, then close; as uvicorn cancels a request's task
        # when service.shutdown_timeout_s runs out, drop it then (this timer is set just
        # before uvicorn's, so the store's close never waits on its reservation).
        self._closing = True
        grace = self.config.timeout_graceful_shutdown
        if grace is not None:
            self.loop.call_later(grace, self._give_up)

    def _give_up(self) -> None:
        if self._put is not None and not self.transport.is_closing():
            log.info("closing a connection whose PUT body was not complete at shutdown")
            self.transport.close()

    def data_received(self, data: bytes) -> None:
        if self._in_head:
            end = head_end(self._tail, data)
            self._head_bytes += end if end >= 0 else len(data)
            self._tail = b"" if end >= 0 else (self._tail + data[-(len(_END) - 1) :])[-3:]
            if self._head_bytes > self.max_header_bytes:
                self._refuse()
                return
        super().data_received(data)
        # The head timer runs only while a head is incomplete after a read: a head that
        # arrives whole in one read (nearly every request) never sets one. It starts at
        # the read that brought the head's first bytes, as a timer set before it would.
        if self._in_head and self._head_timer is None and not self.transport.is_closing():
            self._arm()

    def on_message_begin(self) -> None:
        super().on_message_begin()
        # A request began: not idle. (A direct answer ends its request inside the read,
        # which arms uvicorn's keep-alive timer while the read may hold the next one.)
        self._unset_keepalive_if_required()
        if not self._in_head:  # the next request on a kept-alive connection
            self._in_head = True
            self._head_bytes = 0
            self._tail = b""

    def on_headers_complete(self) -> None:
        self._in_head = False
        self._disarm()
        cycle = self.cycle
        if self.transport.is_closing() and (cycle is None or cycle.response_complete):
            # A request read after a direct answer closed the connection (at shutdown):
            # nobody can be answered, so nothing is started (uvicorn never starts a
            # request queued behind a closing connection either).
            self.cycle = _ANSWERED  # type: ignore[assignment]
            return
        if self.core is not None and self._answer_directly(self.core):
            return
        super().on_headers_complete()

    def on_body(self, body: bytes) -> None:
        if self._put is not None:
            self._put[1].feed(body)
            return
        super().on_body(body)

    def on_message_complete(self) -> None:
        put, self._put = self._put, None
        if put is None:
            super().on_message_complete()
            return
        taken, into = put
        self._write(taken.finish(not into.overflow and into.pos == into.view.nbytes))

    # -- answers below ASGI ------------------------------------------------------------------

    def _answer_directly(self, core: RequestCore) -> bool:
        parser = self.parser
        cycle = self.cycle
        if (
            (cycle is not None and not cycle.response_complete)
            or self.pipeline
            or self.flow.write_paused  # a client not reading: the ASGI path waits for it
            or self.expect_100_continue
            or not parser.should_keep_alive()
            or parser.should_upgrade()
            or self.transport.is_closing()
        ):
            return False
        # HTTP/1.0 too, when it asks to keep the connection (``Connection: keep-alive``,
        # as ApacheBench's -k and other load tools send): uvicorn closes every 1.0
        # connection after its answer, so without this each such request would pay a
        # new connection as well as the ASGI path.
        version = parser.get_http_version()
        if version != "1.1" and version != "1.0":
            return False
        self._keep_alive_10 = version == "1.0"
        method = parser.get_method()
        try:
            if method == b"GET":
                return self._get(core)
            if method == b"PUT":
                return self._start_put(core)
        except Exception:  # a bug there must not become the parser's 400: ASGI answers
            log.exception("a data-plane answer failed; the request takes the ASGI path")
        return False

    def _admitted(self, core: RequestCore, method: str) -> tuple[Tenant, Head, str] | None:
        """(tenant, head, key) of a one-chunk request the core admits, or None: not one,
        or one the gate refuses (it answers the refusal)."""
        key = chunk_key_of_url(self.url)
        if key is None:
            return None
        head = Head.read(self.headers)
        if not head.plain:
            return None  # the gate's or the parser's business
        verdict = core.admit_route(GET_CHUNK if method == "GET" else PUT_CHUNK, head)
        if not isinstance(verdict, Admitted) or verdict.tenant is None:
            return None
        return verdict.tenant, head, key

    def _get(self, core: RequestCore) -> bool:
        taken = self._admitted(core, "GET")
        if taken is None or taken[1].length:
            return False  # a GET with a body: the routes' business
        tenant, _, key = taken
        t0 = time.perf_counter()
        try:
            got = core.get_now(tenant, key)
        except KVTierError:
            return False  # a closed store: the ASGI path answers it as it always did
        if got is NOT_NOW:
            return False
        if isinstance(got, Answer):
            core.observe("GET", got.status, len(got.body), t0, 0)
            self._write(got)
            return True
        self._send_held(core, got, t0)
        return True

    def _send_held(self, core: RequestCore, held: HeldValue, t0: float) -> None:
        """A 200 sent straight from the tier's slot, held until sent or copied."""
        try:
            core.observe("GET", 200, held.view.nbytes, t0, 0)
            self._send_borrowed(200, _OCTET, held.view)
        except Exception:  # maybe after part of a 200 went out: the connection ends
            log.exception("a data-plane answer failed while it was sent")
            self.transport.abort()
        finally:
            held.release()

    def _start_put(self, core: RequestCore) -> bool:
        taken = self._admitted(core, "PUT")
        if taken is None or taken[1].length is None:
            return False
        tenant, head, key = taken
        try:
            put = core.start_put(tenant, key, head.length or 0)
        except KVTierError:
            return False  # a closed store: the ASGI path answers it as it always did
        if put is None:
            return False
        # No cycle until the answer: on_body feeds the view, on_message_complete answers.
        self._put = (put, _Into(put.view))
        return True

    def _send_borrowed(
        self, status: int, headers: list[tuple[bytes, bytes]], view: memoryview
    ) -> None:
        """Write an answer with ``view`` as its body, done with ``view`` on return.

        Straight from the borrowed memory to the socket (one ``writev``) when nothing
        else waits to be written; what the socket does not take now is copied to the
        transport, which never keeps a reference to the view.
        """
        if self.transport.is_closing():  # nobody to answer, and the fd may be gone
            self._answered()
            return
        head = self._head_bytes_of(status, headers, view.nbytes)
        sock = self.transport.get_extra_info("socket") if self._plain_socket else None
        sent = 0
        if sock is not None and self.transport.get_write_buffer_size() == 0:
            try:
                sent = os.writev(sock.fileno(), [head, view])
            except (BlockingIOError, InterruptedError):
                sent = 0
            except OSError:
                sent = 0  # the transport meets the same error on its next write
        if sent < len(head):
            self.transport.writelines([head[sent:], bytes(view)])
        elif sent < len(head) + view.nbytes:
            self.transport.write(bytes(view[sent - len(head) :]))
        self._answered()

    def _head_bytes_of(self, status: int, headers: list[tuple[bytes, bytes]], n: int) -> bytes:
        head = [STATUS_LINE[status]]
        for name, value in (*self.server_state.default_headers, *headers):
            head += [name, b": ", value, b"\r\n"]
        if self._closing:
            head.append(b"connection: close\r\n")
        elif self._keep_alive_10:
            head.append(b"connection: keep-alive\r\n")
        head.append(b"content-length: %d\r\n\r\n" % n)
        return b"".join(head)

    def _answered(self) -> None:
        self.cycle = _ANSWERED  # type: ignore[assignment]
        if self._closing:
            self.transport.close()
        self.on_response_complete()

    def _write(self, answer: Answer) -> None:
        headers = [(b"content-type", answer.content_type)] if answer.content_type else []
        head = self._head_bytes_of(answer.status, [*headers, *answer.headers], len(answer.body))
        self.transport.writelines([head, answer.body])
        self._answered()

    # -- limits ----------------------------------------------------------------------------

    def _arm(self) -> None:
        self._disarm()
        self._head_timer = self.loop.call_later(self.header_timeout_s, self._too_slow)

    def _disarm(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _too_slow(self) -> None:
        self._head_timer = None
        if self._in_head and not self.transport.is_closing():
            log.debug(
                "closing a connection whose request head took over %.1f s", self.header_timeout_s
            )
            self.transport.close()

    def _refuse(self) -> None:
        self._disarm()
        self._in_head = False
        if self.transport.is_closing():
            return
        body = json.dumps(
            {
                "code": "headers_too_large",
                "message": f"request head over {self.max_header_bytes} B "
                "(service.max_header_bytes)",
            }
        ).encode()
        head = (
            b"HTTP/1.1 431 Request Header Fields Too Large\r\n"
            b"content-type: application/json\r\n"
            b"content-length: " + str(len(body)).encode() + b"\r\n"
            b"connection: close\r\n\r\n"
        )
        self.transport.write(head + body)
        self.transport.close()


class _Into:
    """Where the parser's body pieces of one PUT go: the reserved slot's view."""

    __slots__ = ("overflow", "pos", "view")

    def __init__(self, view: memoryview) -> None:
        self.view = view
        self.pos = 0
        self.overflow = False

    def feed(self, piece: bytes | bytearray) -> None:
        end = self.pos + len(piece)
        if end > self.view.nbytes:
            self.overflow = True  # never written past the view; the body is refused
            return
        self.view[self.pos : end] = piece
        self.pos = end


def protocol_class(
    max_header_bytes: int, header_timeout_s: float, core: RequestCore | None = None
) -> type[HttpToolsProtocol]:
    """The protocol class for one daemon (uvicorn's ``http`` setting): its head limits,
    and its request core to answer one-chunk GETs and PUTs with (None: none here)."""
    return type(
        "KVTierHttpProtocol",
        (DataPlaneProtocol,),
        {
            "max_header_bytes": max_header_bytes,
            "header_timeout_s": header_timeout_s,
            "core": core,
        },
    )
