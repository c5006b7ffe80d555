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
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

log = logging.getLogger(__name__)

_END = b"\r\n\r\n"


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

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._in_head = True
        self._head_bytes = 0
        self._tail = b""
        self._head_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

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
        if not self._in_head:  # the next request on a kept-alive connection
            self._in_head = True
            self._head_bytes = 0
            self._tail = b""
            self._arm()

    def on_headers_complete(self) -> None:
        self._in_head = False
        self._disarm()
        super().on_headers_complete()

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


def protocol_class(max_header_bytes: int, header_timeout_s: float) -> type[HttpToolsProtocol]:
    """The protocol class for one daemon's limits (uvicorn's ``http`` setting)."""
    return type(
        "KVTierHttpProtocol",
        (LimitedHttpToolsProtocol,),
        {"max_header_bytes": max_header_bytes, "header_timeout_s": header_timeout_s},
    )
