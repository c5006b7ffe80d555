"""Batches: lookup, batch get and batch put (the KVTB body format of :mod:`..wire`)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response

from kvtier.errors import InputError
from kvtier.store.types import PutResult

from .. import wire
from ..core import RequestCore
from ..errors import ApiError
from ..guards import read_body
from ..schemas import KeysRequest, LookupResponse, PutResponse
from .common import BINARY_BODY, OCTET, TenantDep, put_response, route
from .table import BATCH_GET, BATCH_PUT, LOOKUP


async def _wait(fut: Any) -> Any:
    return await asyncio.wrap_future(fut)


def router(core: RequestCore) -> APIRouter:
    d = core.d
    api = APIRouter(tags=["batch"])

    @route(api, LOOKUP)
    async def lookup(req: KeysRequest, t: TenantDep) -> LookupResponse:
        res = await core.lookup(t, d.keys(t, req.keys))
        return LookupResponse(hits=res.hits, tiers=list(res.tiers))

    @route(
        api,
        BATCH_GET,
        response_class=Response,
        responses={
            200: {"description": "A batch body (KVTB format) of the leading hits.", **BINARY_BODY}
        },
    )
    async def batch_get(req: KeysRequest, request: Request, t: TenantDep) -> Response:
        return Response(await core.batch_get(t, req.keys, request.scope), media_type=OCTET)

    @route(
        api,
        BATCH_PUT,
        openapi_extra={"requestBody": {"required": True, **BINARY_BODY}},
    )
    async def batch_put(request: Request, t: TenantDep) -> PutResponse:
        body = await read_body(request, d.limits.max_body_bytes, "batch body")
        try:
            batch = wire.parse(
                body,
                max_count=d.limits.max_batch_keys,
                max_value_bytes=d.limits.max_value_bytes,
                max_prefix=d.limits.max_prefix_keys,
            )
        except InputError as exc:
            raise ApiError(400, "bad_batch", str(exc)) from None
        if len(set(batch.keys)) != len(batch.keys):
            raise ApiError(400, "duplicate_key", "a batch names the same key twice")
        ikeys = d.mapper.map(t, batch.keys)
        iprefix = d.mapper.map(t, batch.prefix) if batch.prefix else []
        runs = wire.runs(batch)
        # A batch that names a prefix is one sequence: a run's prefix is the chunks before
        # the batch, then the batch's own before the run (the store pins those present).
        futs: list[Awaitable[PutResult]] = [
            _wait(
                d.store.put(
                    ikeys[r.start : r.start + r.count],
                    r.data,
                    prefix=[*iprefix, *ikeys[: r.start]] if iprefix else (),
                )
            )
            for r in runs
        ]
        results = list(await asyncio.gather(*futs))
        for res, r in zip(results, runs, strict=True):
            core.counted_put(t, res, r.value_bytes)
        return put_response(results)

    return api
