"""Pure-ASGI guards that run before any route reads a body.

:class:`Gate` decides from the request head alone, before one body byte is read:

1. one ``Authorization`` header at most (two could be read differently by two layers:
   refused, 400);
2. a known token for ``/v1/*`` and ``/metrics`` (401), so an anonymous client cannot make
   the daemon parse a large body;
3. a declared ``Content-Length`` within the route's own limit (413): a value for
   ``PUT /v1/chunks``, ``service.max_body_bytes`` for a batch put, and what
   ``service.max_batch_keys`` keys can take for the JSON routes;
4. room in the byte budget that bounds every body in flight together
   (``service.max_inflight_bytes``): a request that does not fit waits up to
   ``service.inflight_wait_s`` for room, then 503 with ``Retry-After``.

A body without a declared length (chunked) is counted as it arrives, against the same
limit and the same budget. Routes that allocate a response buffer (batch get) take it
from the budget too (:meth:`Budget.hold`); the gate gives everything back when the
request ends.
"""

from __future__ import annotations

import re

from starlette.requests import Request
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from .daemon import Daemon
from .errors import ApiError, ErrorReply, reply_for, send_error
from .limits import HELD, TENANT, busy

_CHUNK = re.compile(r"/v1/chunks/[^/]*")
# One key in a JSON list: 32 hex digits, quotes, a comma and a little whitespace.
_JSON_BYTES_PER_KEY = 40
_JSON_SLACK_BYTES = 4096


def _protected(path: str) -> bool:
    return path.startswith("/v1/") or path == "/metrics"


class Gate:
    """Checks the head of each request before any layer below reads its body."""

    def __init__(self, app: ASGIApp, daemon: Daemon) -> None:
        self.app = app
        self.d = daemon
        lim = daemon.limits
        self.json_limit = _JSON_SLACK_BYTES + _JSON_BYTES_PER_KEY * lim.max_batch_keys

    def limit_for(self, method: str, path: str) -> tuple[int, str]:
        """The largest body this route takes, and the setting that says so."""
        lim = self.d.limits
        if method == "PUT" and _CHUNK.fullmatch(path):
            return lim.max_value_bytes, "service.max_value_bytes"
        if path == "/v1/batch/put":
            return lim.max_body_bytes, "service.max_body_bytes"
        return min(self.json_limit, lim.max_body_bytes), "service.max_batch_keys"

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        auth: list[bytes] = []
        declared = None
        for name, value in scope["headers"]:
            if name == b"authorization":
                auth.append(value)
            elif name == b"content-length":
                try:
                    declared = int(value)
                except ValueError:
                    declared = -1
        reply = self._refusal(scope, auth, declared)
        if reply is not None:
            await send_error(send, reply)
            return
        limit, setting = self.limit_for(scope["method"], scope["path"])
        budget = self.d.budget
        if declared is not None and declared > limit:
            what = f"body of {declared} B; the limit is {limit} B ({setting})"
            await send_error(send, ErrorReply(413, "body_too_large", what))
            return
        if declared and not await budget.acquire(declared):
            refused = reply_for(busy(budget))
            assert refused is not None
            await send_error(send, refused)
            return
        scope[HELD] = declared or 0
        counted = declared is not None
        seen = 0

        async def limited() -> Message:
            nonlocal seen
            msg = await receive()
            if msg["type"] == "http.request":
                n = len(msg.get("body", b""))
                seen += n
                if seen > limit:
                    raise ApiError(413, "body_too_large", f"body over the limit of {limit} B")
                if not counted and n:
                    budget.hold(scope, n)
            return msg

        try:
            await self.app(scope, limited, send)
        finally:
            budget.give(scope.get(HELD, 0))

    def _refusal(self, scope: Scope, auth: list[bytes], declared: int | None) -> ErrorReply | None:
        if len(auth) > 1:
            return ErrorReply(
                400, "duplicate_authorization", "send one Authorization header, not several"
            )
        if declared is not None and declared < 0:
            return ErrorReply(400, "bad_length", "Content-Length is not a number")
        if not _protected(scope["path"]):
            return None
        tenant = self.d.auth.authenticate(auth[0].decode("latin-1") if auth else None)
        if tenant is None:
            return ErrorReply(
                401,
                "unauthorized",
                "a valid bearer token is required (Authorization: Bearer <token>)",
                {"WWW-Authenticate": "Bearer"},
            )
        scope[TENANT] = tenant
        return None


async def read_body(request: Request, limit: int, what: str) -> bytes:
    """The whole body, refused with 413 past ``limit`` bytes (one copy: the join)."""
    parts: list[bytes] = []
    n = 0
    async for part in request.stream():
        n += len(part)
        if n > limit:
            raise ApiError(413, "body_too_large", f"{what} over the limit of {limit} B")
        parts.append(part)
    return b"".join(parts)
