"""One mapping from errors to HTTP answers, for every route and front end.

Every refusal is a 4xx (or a 503 the client may retry) with an
:class:`~kvtier.service.schemas.ErrorResponse` body. :func:`reply_for` is the only
place an exception becomes a status and a code: FastAPI's exception handlers
(:func:`install`), the request core (:mod:`kvtier.service.core`) and the gate
(:mod:`kvtier.service.guards`) all call it, so a route answers the same error the same
way whichever front end served it. An exception it does not know is a bug: a 500.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import Send

from kvtier.errors import ClosedError, InputError, NotDurableError, TierError


class ApiError(StarletteHTTPException):
    """A refusal with a machine-readable code. Subclasses HTTPException so FastAPI's own
    body parsing lets it through unchanged."""

    def __init__(self, status: int, code: str, message: str, headers: dict[str, str] | None = None):
        super().__init__(status, message, headers)
        self.code = code


@dataclass(frozen=True, slots=True)
class ErrorReply:
    """An error answer: status, machine-readable code, message, extra headers."""

    status: int
    code: str
    message: str
    headers: dict[str, str] = field(default_factory=dict)

    def body(self) -> bytes:
        return json.dumps({"code": self.code, "message": self.message}).encode()


STATUS_CODES = {
    400: "bad_request",
    401: "unauthorized",
    403: "forbidden",
    404: "not_found",
    405: "method_not_allowed",
    413: "body_too_large",
    415: "unsupported_media_type",
    422: "invalid_request",
    431: "headers_too_large",
    503: "unavailable",
}

RETRY_AFTER_S = 1
"""What a 503 asks the client to wait before it retries, in seconds."""


def reply_for(exc: BaseException) -> ErrorReply | None:
    """The answer to ``exc``, or None for an exception that is a bug (a 500)."""
    if isinstance(exc, ApiError):
        return ErrorReply(exc.status_code, exc.code, str(exc.detail), dict(exc.headers or {}))
    if isinstance(exc, StarletteHTTPException):
        code = STATUS_CODES.get(exc.status_code, "error")
        status = exc.status_code if 400 <= exc.status_code < 500 or exc.status_code == 503 else 400
        return ErrorReply(status, code, str(exc.detail), dict(exc.headers or {}))
    if isinstance(exc, RequestValidationError):
        parts = []
        for e in exc.errors()[:5]:
            loc = ".".join(str(x) for x in e.get("loc", ()))
            parts.append(f"{loc}: {e.get('msg', 'invalid')}")
        return ErrorReply(422, "invalid_request", "; ".join(parts) or "invalid request")
    if isinstance(exc, InputError):
        return ErrorReply(400, "bad_input", str(exc))
    if isinstance(exc, ClosedError):
        return ErrorReply(
            503,
            "shutting_down",
            "the daemon is shutting down; retry on another one",
            {"Retry-After": str(RETRY_AFTER_S)},
        )
    if isinstance(exc, NotDurableError):
        return ErrorReply(503, "not_durable", str(exc), {"Retry-After": str(RETRY_AFTER_S)})
    if isinstance(exc, TierError):
        return ErrorReply(503, "tier_failed", str(exc), {"Retry-After": str(RETRY_AFTER_S)})
    return None


def json_error(reply: ErrorReply) -> JSONResponse:
    """``reply`` as a FastAPI response."""
    return JSONResponse(
        {"code": reply.code, "message": reply.message}, reply.status, headers=reply.headers
    )


def error(
    status: int, code: str, message: str, headers: dict[str, str] | None = None
) -> JSONResponse:
    """An error response built in place (a refusal that is not an exception)."""
    return json_error(ErrorReply(status, code, message, headers or {}))


async def send_error(send: Send, reply: ErrorReply) -> None:
    """``reply`` sent through a raw ASGI ``send`` (layers below FastAPI)."""
    body = reply.body()
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
    ]
    headers += [
        (k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in reply.headers.items()
    ]
    await send({"type": "http.response.start", "status": reply.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def install(app: FastAPI) -> None:
    """Route every known error through :func:`reply_for`."""

    async def handle(_: Request, exc: Exception) -> JSONResponse:
        reply = reply_for(exc)
        if reply is None:  # not reached: only known types are registered below
            raise exc
        return json_error(reply)

    known = (
        StarletteHTTPException,
        RequestValidationError,
        InputError,
        ClosedError,
        NotDurableError,
        TierError,
    )
    for cls in known:
        app.add_exception_handler(cls, handle)
