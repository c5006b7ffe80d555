"""One chunk: PUT, GET, HEAD, DELETE of ``/v1/chunks/{key}``, answered by the request core.

The data-plane front end (:mod:`kvtier.service.dataplane`) answers most well-formed GETs
and PUTs before they reach these routes; both call the same
:class:`~kvtier.service.core.RequestCore` and send its answers' bytes as they are. These
routes answer the rest, and make the OpenAPI document.
"""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import Response

from ..core import RequestCore
from ..guards import read_body
from ..schemas import DeleteResponse, ErrorResponse, PutResponse
from .common import BINARY_BODY, KeyPath, TenantDep, respond, route
from .table import DELETE_CHUNK, GET_CHUNK, HEAD_CHUNK, PUT_CHUNK


def router(core: RequestCore) -> APIRouter:
    api = APIRouter(tags=["chunks"])
    limits = core.d.limits

    @route(
        api,
        PUT_CHUNK,
        response_model=PutResponse,
        openapi_extra={"requestBody": {"required": True, **BINARY_BODY}},
    )
    async def put_chunk(key: KeyPath, request: Request, t: TenantDep) -> Response:
        body = await read_body(request, limits.max_value_bytes, "value")
        return respond(await core.put(t, key, body))

    @route(
        api,
        GET_CHUNK,
        response_class=Response,
        responses={
            200: {"description": "The value's bytes.", **BINARY_BODY},
            404: {"model": ErrorResponse, "description": "Not present (for this tenant)."},
        },
    )
    async def get_chunk(key: KeyPath, t: TenantDep) -> Response:
        return respond(await core.get(t, key))

    @route(
        api,
        HEAD_CHUNK,
        response_class=Response,
        responses={200: {"description": "Present."}, 404: {"description": "Not present."}},
    )
    async def head_chunk(key: KeyPath, t: TenantDep) -> Response:
        return respond(await core.exists(t, key))

    @route(
        api,
        DELETE_CHUNK,
        response_model=DeleteResponse,
        responses={
            503: {
                "model": ErrorResponse,
                "description": "not_durable: removed here, but a persistent tier with "
                "durability = sync could not make it durable (a full disk); retry.",
            }
        },
    )
    async def delete_chunk(key: KeyPath, t: TenantDep) -> Response:
        return respond(await core.delete(t, key))

    return api
