"""A pure-ASGI fast path for the hottest routes: GET and PUT of one chunk, batch get.

FastAPI's dependency solving and validation cost about a millisecond of CPU per
request on a loaded 2-core host, more than moving a 256 KiB value. This layer answers
well-formed ``GET``/``PUT /v1/chunks/{32 hex}`` requests that the gate
(:mod:`kvtier.service.guards`) authenticated itself, calling the same
:class:`~kvtier.service.daemon.Daemon` methods as the FastAPI routes. Anything else (a
bad key, a chunked upload, a body over the limit) falls through untouched to the
FastAPI routes, which own the OpenAPI document. The fast path never reads a body it then
passes on, and answers errors through the same mapping as the routes
(:func:`kvtier.service.errors.reply_for`): an ``InputError`` is a 400 here as there.

``POST /v1/batch/get`` with a JSON body that is exactly ``{"keys": [32-hex, ...]}`` is
answered here too (by :meth:`~kvtier.service.daemon.Daemon.batch_get`, which the route
also calls); the gate has already bounded that body. Any other body is handed on, as
read, to the FastAPI route, which answers it (validation errors included) as before.
"""

from __future__ import annotations

import json
import re
from collections.abc import Coroutine
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from .core import Answer, RequestCore, bad_length, error_answer
from .errors import reply_for, send_error
from .headlimit import BODY_INTO, BodyInto
from .limits import BODY_BYTES, TENANT
from .routes.table import BATCH_GET as BATCH_GET_ROUTE
from .routes.table import CHUNK_TEMPLATE, KEY_PATTERN, chunk_key

_KEY = re.compile(KEY_PATTERN)
BATCH_GET = BATCH_GET_ROUTE.template
OCTET = b"application/octet-stream"


class _Route:
    """Stands in for the matched route, so metrics label fast-path requests alike."""

    def __init__(self, path: str) -> None:
        self.path = path


_ROUTE = _Route(CHUNK_TEMPLATE)
_BATCH_ROUTE = _Route(BATCH_GET)


class FastPath:
    def __init__(self, app: ASGIApp, core: RequestCore) -> None:
        self.app = app
        self.core = core
        self.d = core.d

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] in ("GET", "PUT"):
            key = chunk_key(scope["path"])
            tenant = scope.get(TENANT)
            if key is not None and tenant is not None:
                if scope["method"] == "GET":
                    scope["route"] = _ROUTE
                    await self._answer(self._get(tenant, key, send), send)
                    return
                length = _content_length(dict(scope["headers"]))
                if length is not None and 0 < length <= self.d.limits.max_value_bytes:
                    scope["route"] = _ROUTE
                    await self._answer(self._put(scope, tenant, key, length, receive, send), send)
                    return
        elif scope["type"] == "http" and scope["method"] == "POST" and scope["path"] == BATCH_GET:
            tenant = scope.get(TENANT)
            headers = dict(scope["headers"])
            if tenant is not None and headers.get(b"content-type") == b"application/json":
                body = await _receive_all(receive)
                if body is None:
                    return  # the client went away mid-body: nobody to answer
                keys = _batch_keys(body)
                if keys is not None:
                    scope["route"] = _BATCH_ROUTE
                    await self._answer(self._batch_get(scope, tenant, keys, send), send)
                    return
                receive = _replay(body, receive)
        await self.app(scope, receive, send)

    async def _batch_get(self, scope: Scope, tenant: Any, keys: list[str], send: Send) -> None:
        await _respond(send, 200, OCTET, await self.d.batch_get(tenant, keys, scope))

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
        await _send(send, await self.core.get(tenant, key))

    async def _put(
        self, scope: Scope, tenant: Any, key: str, length: int, receive: Receive, send: Send
    ) -> None:
        scope_into: BodyInto | None = scope.get(BODY_INTO)
        res = self.core.reserve(tenant, key, length)
        if res is None:
            # The store cannot give a slot to fill in place (present key, full top tier,
            # a tier behind I/O): receive into one buffer and let the store copy it.
            buf = self.d.values.take(length)
            got = await _receive_into(buf.data, receive)
            if got == length:
                scope[BODY_BYTES] = got
                await _send(send, await self.core.put(tenant, key, buf.data))
            else:
                await _send(send, error_answer(bad_length()))
            return
        try:
            # One copy in the daemon: from the parser's pieces into the tier's slot.
            got = await (scope_into(res.view) if scope_into else _receive_into(res.view, receive))
            if got != length:
                res.abort()
                await _send(send, error_answer(bad_length()))
                return
            scope[BODY_BYTES] = got
            await _send(send, self.core.commit(tenant, res))
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


async def _receive_all(receive: Receive) -> bytes | None:
    """The whole body (the gate bounds its length), or None when the client went away."""
    parts: list[bytes] = []
    more = True
    while more:
        msg = await receive()
        if msg["type"] != "http.request":
            return None
        parts.append(msg.get("body", b""))
        more = msg.get("more_body", False)
    return b"".join(parts)


def _replay(body: bytes, receive: Receive) -> Receive:
    """A receive that gives ``body`` (already read) once, then what ``receive`` gives."""
    given = False

    async def again() -> Message:
        nonlocal given
        if not given:
            given = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return again


def _batch_keys(body: bytes) -> list[str] | None:
    """The keys of a ``{"keys": [...]}`` body of well-formed keys; None for anything else
    (the route then answers it, with the errors it always gave)."""
    try:
        doc = json.loads(body)
    except ValueError:
        return None
    if not isinstance(doc, dict) or doc.keys() != {"keys"}:
        return None
    keys = doc["keys"]
    if not isinstance(keys, list) or not all(
        isinstance(k, str) and _KEY.fullmatch(k) for k in keys
    ):
        return None
    return keys


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


async def _send(send: Send, answer: Answer) -> None:
    headers = [(b"content-length", str(len(answer.body)).encode()), *answer.headers]
    if answer.content_type is not None:
        headers.append((b"content-type", answer.content_type))
    await send({"type": "http.response.start", "status": answer.status, "headers": headers})
    await send({"type": "http.response.body", "body": answer.body})
