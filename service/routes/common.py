"""What the route modules share: the tenant dependency, the key parameter, body docs, and
the one way a route of the table (:mod:`.table`) becomes a FastAPI route."""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated, Any, TypeVar

from fastapi import APIRouter, Depends, Path, Request, Security
from fastapi.responses import Response
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from kvtier.store.types import PutResult

from .. import wire
from ..core import Answer, RequestCore, unauthorized
from ..errors import ApiError
from ..limits import TENANT
from ..schemas import PutResponse
from ..tenants import Tenant
from .table import KEY_PATTERN, Route

OCTET = wire.MEDIA_TYPE
BINARY_BODY: dict[str, Any] = {
    "content": {OCTET: {"schema": {"type": "string", "format": "binary"}}}
}
F = TypeVar("F", bound=Callable[..., Any])

_bearer = HTTPBearer(auto_error=False, description="A token from [service.tokens].")


def _tenant(
    request: Request, cred: Annotated[HTTPAuthorizationCredentials | None, Security(_bearer)]
) -> Tenant:
    t = request.scope.get(TENANT)  # the gate authenticated it before the body was read
    if t is None:
        core: RequestCore = request.app.state.core
        t = core.tenant(f"Bearer {cred.credentials}" if cred else None)
    if t is None:
        reply = unauthorized()
        raise ApiError(reply.status, reply.code, reply.message, reply.headers)
    return t


TenantDep = Annotated[Tenant, Depends(_tenant)]
KeyPath = Annotated[
    str, Path(pattern=KEY_PATTERN, description="The chunk key: 32 hex digits (16 bytes).")
]


def route(api: APIRouter, r: Route, **kw: Any) -> Callable[[F], F]:
    """Register the decorated function as route ``r`` of the table."""
    return api.api_route(r.template, methods=[r.method], summary=r.summary, **kw)


def respond(answer: Answer) -> Response:
    """A core's answer as a FastAPI response: the same bytes the data plane sends."""
    headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in answer.headers}
    ctype = answer.content_type
    return Response(
        answer.body, answer.status, headers, media_type=ctype.decode("latin-1") if ctype else None
    )


def put_response(results: list[PutResult]) -> PutResponse:
    return PutResponse(
        stored=sum(r.stored for r in results),
        present=sum(r.present for r in results),
        rejected=sum(r.rejected for r in results),
        failed=sum(r.failed for r in results),
    )
