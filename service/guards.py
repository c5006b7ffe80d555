"""Pure-ASGI guards that run before any route reads a body.

:class:`BodyLimit` refuses a body over ``service.max_body_bytes``: a declared
Content-Length over the limit at once, a chunked body when it crosses the limit.
"""

from __future__ import annotations

from starlette.requests import Request
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from .errors import ApiError, ErrorReply, send_error


class BodyLimit:
    """Refuses bodies over ``limit`` bytes before any route reads them."""

    def __init__(self, app: ASGIApp, limit: int) -> None:
        self.app = app
        self.limit = limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        for name, value in scope.get("headers", ()):
            if name == b"content-length":
                try:
                    declared = int(value)
                except ValueError:
                    declared = -1
                if declared > self.limit:
                    reply = ErrorReply(
                        413,
                        "body_too_large",
                        f"body of {declared} B; the limit is {self.limit} B "
                        "(service.max_body_bytes)",
                    )
                    await send_error(send, reply)
                    return
        seen = 0

        async def limited() -> Message:
            nonlocal seen
            msg = await receive()
            if msg["type"] == "http.request":
                seen += len(msg.get("body", b""))
                if seen > self.limit:
                    raise ApiError(413, "body_too_large", f"body over the limit of {self.limit} B")
            return msg

        await self.app(scope, limited, send)


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
