"""What the route modules share: the tenant dependency, the key parameter, body docs."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import Depends, Path, Request, Security
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from kvtier.store.types import PutResult

from .. import wire
from ..daemon import Daemon
from ..errors import ApiError
from ..limits import TENANT
from ..schemas import KEY_PATTERN, PutResponse
from ..tenants import Tenant

OCTET = wire.MEDIA_TYPE
BINARY_BODY: dict[str, Any] = {
    "content": {OCTET: {"schema": {"type": "string", "format": "binary"}}}
}

_bearer = HTTPBearer(auto_error=False, description="A token from [service.tokens].")


def _tenant(
    request: Request, cred: Annotated[HTTPAuthorizationCredentials | None, Security(_bearer)]
) -> Tenant:
    t = request.scope.get(TENANT)  # the gate authenticated it before the body was read
    if t is None:
        d: Daemon = request.app.state.daemon
        t = d.auth.authenticate(f"Bearer {cred.credentials}" if cred else None)
    if t is None:
        raise ApiError(
            401,
            "unauthorized",
            "a valid bearer token is required (Authorization: Bearer <token>)",
            {"WWW-Authenticate": "Bearer"},
        )
    return t


TenantDep = Annotated[Tenant, Depends(_tenant)]
KeyPath = Annotated[
    str, Path(pattern=KEY_PATTERN, description="The chunk key: 32 hex digits (16 bytes).")
]


def put_response(results: list[PutResult]) -> PutResponse:
    return PutResponse(
        stored=sum(r.stored for r in results),
        present=sum(r.present for r in results),
        rejected=sum(r.rejected for r in results),
        failed=sum(r.failed for r in results),
    )
