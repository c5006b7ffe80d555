"""Pure-ASGI guards that run before any route reads a body.

:class:`Gate` decides from the request head alone, before one body byte is read (1-3
are the request core's admission, :meth:`~kvtier.service.core.RequestCore.admit`, which
the data-plane front end applies too):

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

from starlette.requests import Request
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from .core import Head, RequestCore
from .errors import ApiError, ErrorReply, reply_for, send_error
from .limits import HELD, TENANT, busy


class Gate:
    """Checks the head of each request before any layer below reads its body: the
    request core admits it (:meth:`~kvtier.service.core.RequestCore.admit`), then the
    gate holds its bytes in the in-flight budget until the request ends."""

    def __init__(self, app: ASGIApp, core: RequestCore) -> None:
        self.app = app
        self.core = core

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        head = Head.read(scope["headers"])
        verdict = self.core.admit(scope["method"], scope["path"], head)
        if isinstance(verdict, ErrorReply):
            await send_error(send, verdict)
            return
        if verdict.tenant is not None:
            scope[TENANT] = verdict.tenant
        limit = verdict.limit_bytes
        declared = head.length
        budget = self.core.d.budget
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
