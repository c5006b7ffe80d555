"""One chunk: PUT, GET, HEAD, DELETE of ``/v1/chunks/{key}``.

The fast path (:mod:`kvtier.service.fastpath`) answers most well-formed GETs and PUTs
before they reach these routes; both call the same :class:`~kvtier.service.daemon.Daemon`
methods, and these routes own the documented errors and the OpenAPI document.
"""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import Response

from ..daemon import Daemon
from ..errors import error
from ..guards import read_body
from ..schemas import DeleteResponse, ErrorResponse, PutResponse
from .common import BINARY_BODY, OCTET, KeyPath, TenantDep, put_response


def router(d: Daemon) -> APIRouter:
    api = APIRouter(tags=["chunks"])

    @api.put(
        "/v1/chunks/{key}",
        summary="Store one value (write-once: a present key is left as it is).",
        openapi_extra={"requestBody": {"required": True, **BINARY_BODY}},
    )
    async def put_chunk(key: KeyPath, request: Request, t: TenantDep) -> PutResponse:
        body = await read_body(request, d.limits.max_value_bytes, "value")
        return put_response([await d.put_value(t, key, body)])

    @api.get(
        "/v1/chunks/{key}",
        summary="Read one value.",
        response_class=Response,
        responses={
            200: {"description": "The value's bytes.", **BINARY_BODY},
            404: {"model": ErrorResponse, "description": "Not present (for this tenant)."},
        },
    )
    async def get_chunk(key: KeyPath, t: TenantDep) -> Response:
        value = await d.get_value(t, key)
        if value is None:
            return error(404, "not_found", f"key {key} is not present")
        return Response(value, media_type=OCTET)

    @api.head(
        "/v1/chunks/{key}",
        summary="Whether a key is present (200) or not (404); no body.",
        response_class=Response,
        responses={200: {"description": "Present."}, 404: {"description": "Not present."}},
    )
    async def head_chunk(key: KeyPath, t: TenantDep) -> Response:
        hit = (await d.lookup([d.key(t, key)])).hits
        d.tenants.add(t.name, lookup_hit_chunks=hit, lookup_miss_chunks=1 - hit)
        return Response(status_code=200 if hit else 404)

    @api.delete(
        "/v1/chunks/{key}",
        summary="Remove one key (idempotent).",
        responses={
            503: {
                "model": ErrorResponse,
                "description": "not_durable: removed here, but a persistent tier with "
                "durability = sync could not make it durable (a full disk); retry.",
            }
        },
    )
    async def delete_chunk(key: KeyPath, t: TenantDep) -> DeleteResponse:
        return DeleteResponse(deleted=await d.delete([d.key(t, key)]))

    return api
