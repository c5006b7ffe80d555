"""A pure-ASGI fast path for the hottest routes: GET and PUT of one chunk.

FastAPI's dependency solving and validation cost about a millisecond of CPU per
request on a loaded 2-core host, more than moving a 256 KiB value. This layer answers
well-formed ``GET``/``PUT /v1/chunks/{32 hex}`` requests that the gate
(:mod:`kvtier.service.guards`) authenticated itself, calling the same
:class:`~kvtier.service.daemon.Daemon` methods as the FastAPI routes. Anything else (a
bad key, a chunked upload, a body over the limit) falls through untouched to the
FastAPI routes, which own the OpenAPI document. The fast path never reads a body it then
passes on, and answers errors through the same mapping as the routes
(:func:`kvtier.service.errors.reply_for`): an ``InputError`` is a 400 here as there.
"""

from __future__ import annotations

import json
import re
from collections.abc import Coroutine
from typing import Any

import numpy as np
from starlette.types import ASGIApp, Receive, Scope, Send

from kvtier.store.types import PutResult

from .daemon import Daemon
from .errors import reply_for, send_error
from .headlimit import BODY_INTO, BodyInto
from .limits import BODY_BYTES, TENANT

_CHUNK_PATH = re.compile(r"/v1/chunks/([0-9a-fA-F]{32})")
OCTET = b"application/octet-stream"


class _Route:
    """Stands in for the matched route, so metrics label fast-path requests alike."""

    path = "/v1/chunks/{key}"


_ROUTE = _Route()


class FastPath:
    def __init__(self, app: ASGIApp, daemon: Daemon) -> None:
        self.app = app
        self.d = daemon

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] in ("GET", "PUT"):
            m = _CHUNK_PATH.fullmatch(scope["path"])
            tenant = scope.get(TENANT)
            if m is not None and tenant is not None:
                if scope["method"] == "GET":
                    scope["route"] = _ROUTE
                    await self._answer(self._get(tenant, m.group(1), send), send)
                    return
                length = _content_length(dict(scope["headers"]))
                if length is not None and 0 < length <= self.d.limits.max_value_bytes:
                    scope["route"] = _ROUTE
                    await self._answer(
                        self._put(scope, tenant, m.group(1), length, receive, send), send
                    )
                    return
        await self.app(scope, receive, send)

    @staticmethod
    async def _answer(work: Coroutine[Any, Any, None], send: Send) -> None:
        """Run one fast-path request; an error becomes the answer any route would give.

        Errors are raised before the response starts (the store answers first), so an
        error answer can always still be sent.
        """
        try:
            await work
        except Exception as exc:
            reply = reply_for(exc)
            if reply is None:
                raise
            await send_error(send, reply)

    async def _get(self, tenant: Any, key: str, send: Send) -> None:
        value = await self.d.get_value(tenant, key)
        if value is None:
            body = json.dumps({"code": "not_found", "message": f"key {key} is not present"})
            await _respond(send, 404, b"application/json", body.encode())
            return
        await _respond(send, 200, OCTET, value)

    async def _put(
        self, scope: Scope, tenant: Any, key: str, length: int, receive: Receive, send: Send
    ) -> None:
        scope_into: BodyInto | None = scope.get(BODY_INTO)
        res = self.d.reserve(tenant, key, length)
        if res is None:
            # The store cannot give a slot to fill in place (present key, full top tier,
            # a tier behind I/O): receive into one buffer and let the store copy it.
            buf = np.empty(length, dtype=np.uint8)
            got = await _receive_into(buf.data, receive)
            if got == length:
                scope[BODY_BYTES] = got
                await _put_answer(send, await self.d.put_value(tenant, key, buf.data))
            else:
                await _bad_length(send, got)
            return
        try:
            # One copy in the daemon: from the parser's pieces into the tier's slot.
            got = await (scope_into(res.view) if scope_into else _receive_into(res.view, receive))
            if got != length:
                res.abort()
                await _bad_length(send, got)
                return
            scope[BODY_BYTES] = got
            await _put_answer(send, self.d.commit(tenant, res))
        finally:
            res.abort()  # a no-op once committed


async def _receive_into(view: memoryview, receive: Receive) -> int:
    """Receive a body into ``view``: its length when it filled ``view`` exactly, else -1
    (more bytes than the view holds, fewer, or the client went away)."""
    pos = 0
    more = True
    while more:
        msg = await receive()
        if msg["type"] != "http.request":
            return -1
        piece = msg.get("body", b"")
        if pos + len(piece) > view.nbytes:
            return -1
        view[pos : pos + len(piece)] = piece
        pos += len(piece)
        more = msg.get("more_body", False)
    return pos if pos == view.nbytes else -1


async def _bad_length(send: Send, got: int) -> None:
    # -1 also covers a client that went away: the answer then goes nowhere, harmlessly.
    await _error(send, 400, "bad_length", "body length differs from its Content-Length")


async def _put_answer(send: Send, res: PutResult) -> None:
    body = json.dumps(
        {
            "stored": res.stored,
            "present": res.present,
            "rejected": res.rejected,
            "failed": res.failed,
        }
    )
    await _respond(send, 200, b"application/json", body.encode())


def _content_length(headers: dict[bytes, bytes]) -> int | None:
    raw = headers.get(b"content-length")
    if raw is None or b"transfer-encoding" in headers:
        return None
    try:
        return int(raw)
    except ValueError:
        return None


async def _respond(send: Send, status: int, content_type: bytes, body: bytes | memoryview) -> None:
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", content_type),
                (b"content-length", str(len(body)).encode()),
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})


async def _error(send: Send, status: int, code: str, message: str) -> None:
    body = json.dumps({"code": code, "message": message}).encode()
    await _respond(send, status, b"application/json", body)
