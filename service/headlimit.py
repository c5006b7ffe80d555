"""uvicorn's httptools protocol with a bound on the request head: size and time.

httptools accumulates a header value by concatenation, so a huge header costs time
quadratic in its size: a 64 MiB header took 5.8 s of daemon CPU and delayed every other
request (issue 11). This protocol counts the bytes of a request's head *before* handing
them to the parser and answers ``431`` past ``service.max_header_bytes``; a client that
takes longer than ``service.header_timeout_s`` to send a head (from its first byte, or
from the connection's start) is disconnected. Bodies are not affected: once a head is
complete, data goes straight to the parser.

Counting is exact up to the read that completes a head; a pipelined request that starts
inside another's read is counted from the next read on, so the bound holds within one
read (at most 256 KiB) of ``max_header_bytes``.

Two cheaper paths for the binary routes (issue 15), both invisible to the ASGI app:

* **Bodies into their destination.** Each request's scope carries an awaitable
  ``scope[BODY_INTO](view)`` (:data:`BODY_INTO`). A route that knows where a body goes
  (the fast path's ``PUT``: a slot of the store's top tier) passes a writable view of
  exactly ``Content-Length`` bytes; the parser's pieces are then copied straight into it
  as they arrive, in the protocol, with no bytearray in between, no ``bytes`` copy per
  ``receive`` and no pause/resume of reading every 64 KiB. The view's size bounds what
  is written; a body that does not fill it exactly is reported, never half-used.
* **The head with the first body piece.** A response's head is held back and written
  together with its first body piece (one ``writelines``): the client wakes once per
  answer instead of twice, which costs a scheduling round on a loaded host.

And answers below ASGI: a daemon's :class:`Direct` (the one-chunk ``GET`` and ``PUT``,
:mod:`kvtier.service.direct`) is asked when a plain keep-alive request's head is complete
and nothing else is in flight on the connection or waiting to be written. A GET it takes
is answered at once; a PUT it takes has its body's pieces copied into the view it gives,
and is answered when the body ends; no task, request cycle or ASGI layer either way.
What it declines takes the ASGI path as before.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

from uvicorn.protocols.http.flow_control import HIGH_WATER_LIMIT
from uvicorn.protocols.http.httptools_impl import (
    STATUS_LINE,
    HttpToolsProtocol,
    RequestResponseCycle,
)

from .core import Answer

log = logging.getLogger(__name__)

_END = b"\r\n\r\n"

BODY_INTO = "kvtier.body_into"
"""Scope key of ``async (view: memoryview) -> int``: receive the body into ``view``.

Returns the body's length when it filled ``view`` exactly, or -1 (the client went away,
or sent more or fewer bytes than ``view`` holds). Call it at most once, before any
``receive()``; servers other than the daemon's leave the key out."""
BodyInto = Callable[[memoryview], Awaitable[int]]


class HeldAnswer(Protocol):
    """An answer whose body is borrowed (a store slot held in place): :attr:`view` may
    be read until :meth:`release`, which the protocol calls once, when the bytes are
    sent or copied."""

    status: int
    headers: list[tuple[bytes, bytes]]
    view: memoryview

    def release(self) -> None: ...


class DirectPut(Protocol):
    """A PUT taken below ASGI: its body goes into :attr:`view`."""

    view: memoryview

    def finish(self, filled: bool) -> Answer:
        """The answer once the body has ended (``filled``: exactly ``view``'s size)."""

    def abort(self) -> None:
        """The connection was lost mid-body."""


class Direct(Protocol):
    """What the protocol asks before it hands a request to ASGI; None: not taken."""

    def get(self, url: bytes, headers: list[tuple[bytes, bytes]]) -> Answer | HeldAnswer | None: ...

    def put(self, url: bytes, headers: list[tuple[bytes, bytes]]) -> DirectPut | None: ...


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


class LimitedHttpToolsProtocol(HttpToolsProtocol):
    """HttpToolsProtocol that refuses large heads (431) and drops slow ones.

    Subclass per daemon through :func:`protocol_class`, which sets the two limits.
    """

    max_header_bytes = 32 * 1024
    header_timeout_s = 10.0
    direct: Direct | None = None

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._in_head = True
        self._head_bytes = 0
        self._tail = b""
        self._head_timer: asyncio.TimerHandle | None = None
        self._into: _Into | None = None
        self._put: tuple[DirectPut, _Into] | None = None
        self._closing = False

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
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
            if self._head_timer is None:
                self._arm()
            end = head_end(self._tail, data)
            self._head_bytes += end if end >= 0 else len(data)
            self._tail = b"" if end >= 0 else (self._tail + data[-(len(_END) - 1) :])[-3:]
            if self._head_bytes > self.max_header_bytes:
                self._refuse()
                return
        super().data_received(data)

    def on_message_begin(self) -> None:
        super().on_message_begin()
        # A request began: not idle. (A direct answer ends its request inside the read,
        # which arms uvicorn's keep-alive timer while the read may hold the next one.)
        self._unset_keepalive_if_required()
        if not self._in_head:  # the next request on a kept-alive connection
            self._in_head = True
            self._head_bytes = 0
            self._tail = b""
            self._arm()

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
        if self.direct is not None and self._answer_directly(self.direct):
            return
        super().on_headers_complete()
        cycle = self.cycle
        if cycle is not None and cycle.scope is self.scope and type(cycle) is RequestResponseCycle:
            # uvicorn builds the cycle itself; its task runs later, so the subclass (same
            # state, one method more) and the scope key are in place before the app runs.
            cycle.__class__ = _Cycle
            assert isinstance(cycle, _Cycle)
            cycle.early = []
            self.scope[BODY_INTO] = lambda view: self._body_into(cycle, view)  # type: ignore[literal-required]

    def on_body(self, body: bytes) -> None:
        if self._put is not None:
            self._put[1].feed(body)
            return
        into = self._into
        cycle = self.cycle
        if into is not None and into.cycle is cycle:
            into.feed(body)
            return
        early = cycle.early if isinstance(cycle, _Cycle) else None
        if early is None or cycle.response_complete:
            super().on_body(body)
            return
        assert isinstance(cycle, _Cycle)
        # Before the app asks: keep the parser's pieces as they are (uvicorn would copy
        # them into a bytearray, then again into bytes), pausing at uvicorn's mark.
        early.append(body)
        cycle.early_bytes += len(body)
        if cycle.early_bytes > HIGH_WATER_LIMIT:
            self.flow.pause_reading()
        cycle.message_event.set()

    def on_message_complete(self) -> None:
        put, self._put = self._put, None
        if put is None:
            super().on_message_complete()
            return
        taken, into = put
        self._write(taken.finish(not into.overflow and into.pos == into.view.nbytes))

    async def _body_into(self, cycle: RequestResponseCycle, view: memoryview) -> int:
        if cycle.waiting_for_100_continue and not self.transport.is_closing():
            self.transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")
            cycle.waiting_for_100_continue = False
        into = _Into(cycle, view)
        early = None
        if isinstance(cycle, _Cycle):
            early, cycle.early = cycle.early, None
        for piece in early or ():  # what came with the head, before the app asked
            into.feed(piece)
        if cycle.body:
            into.feed(cycle.body)
            cycle.body = bytearray()
        self._into = into
        try:
            while cycle.more_body and not cycle.disconnected:
                self.flow.resume_reading()
                await cycle.message_event.wait()
                cycle.message_event.clear()
        finally:
            if self._into is into:
                self._into = None
        if cycle.disconnected or into.overflow or into.pos != view.nbytes:
            return -1
        return into.pos

    def _answer_directly(self, direct: Direct) -> bool:
        parser = self.parser
        cycle = self.cycle
        if (
            (cycle is not None and not cycle.response_complete)
            or self.pipeline
            or self.flow.write_paused  # a client not reading: the ASGI path waits for it
            or self.expect_100_continue
            or parser.get_http_version() != "1.1"
            or not parser.should_keep_alive()
            or parser.should_upgrade()
            or self.transport.is_closing()
        ):
            return False
        method = parser.get_method()
        try:
            answer = direct.get(self.url, self.headers) if method == b"GET" else None
            taken = direct.put(self.url, self.headers) if method == b"PUT" else None
        except Exception:  # a bug there must not become the parser's 400: ASGI answers
            log.exception("a direct answer failed; the request takes the ASGI path")
            return False
        if isinstance(answer, Answer):
            self._write(answer)
            return True
        if answer is not None:
            try:
                self._send_borrowed(answer.status, answer.headers, answer.view)
            except Exception:  # maybe after part of a 200 went out: the connection ends
                log.exception("a direct answer failed while it was sent")
                self.transport.abort()
            finally:
                answer.release()
            return True
        if taken is not None:
            # No cycle until the answer: on_body feeds the view, on_message_complete answers.
            self._put = (taken, _Into(None, taken.view))
            return True
        return False

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
        sock = self.transport.get_extra_info("socket")
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
    """Where the parser's body pieces of one request go (see :data:`BODY_INTO`)."""

    __slots__ = ("cycle", "overflow", "pos", "view")

    def __init__(self, cycle: RequestResponseCycle | None, view: memoryview) -> None:
        self.cycle = cycle
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


class _Cork:
    """Stands in for the transport while a response's head waits for its first body piece."""

    def __init__(self, transport: asyncio.Transport) -> None:
        self.transport = transport
        self.parts: list[bytes | memoryview] = []

    def write(self, data: bytes | memoryview) -> None:
        self.parts.append(data)

    def flush(self) -> None:
        parts, self.parts = self.parts, []
        if parts and not self.transport.is_closing():
            self.transport.writelines(parts)

    def close(self) -> None:
        self.flush()
        self.transport.close()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.transport, name)


class _Cycle(RequestResponseCycle):
    """uvicorn's request cycle, writing the response head with the first body piece,
    and keeping body pieces that arrive before the app asks as a list (``early``)."""

    _cork: _Cork | None = None
    early: list[bytes] | None = None
    early_bytes = 0

    async def receive(self) -> Any:
        early = self.early
        if early is not None:  # the app reads through receive(): hand the pieces over
            self.early = None
            if early:
                self.body += b"".join(early)
        return await super().receive()

    async def send(self, message: Any) -> None:
        if message["type"] == "http.response.start" and not self.response_started:
            real = self.transport
            cork = _Cork(real)
            self.transport = cork  # type: ignore[assignment]
            try:
                await super().send(message)
            except BaseException:
                self.transport = real
                raise
            self._cork = cork
            return
        held = self._cork
        if held is None:
            await super().send(message)
            return
        self._cork = None
        try:
            await super().send(message)
        finally:
            self.transport = held.transport
            held.flush()


def protocol_class(
    max_header_bytes: int, header_timeout_s: float, direct: Direct | None = None
) -> type[HttpToolsProtocol]:
    """The protocol class for one daemon's limits (uvicorn's ``http`` setting), answering
    what ``direct`` takes below ASGI."""
    return type(
        "KVTierHttpProtocol",
        (LimitedHttpToolsProtocol,),
        {
            "max_header_bytes": max_header_bytes,
            "header_timeout_s": header_timeout_s,
            "direct": direct,
        },
    )
