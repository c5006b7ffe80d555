"""Health, readiness, Prometheus metrics and stats."""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import JSONResponse, Response

from ..core import RequestCore
from ..errors import error
from ..metrics import store_exposition, tenant_figures_exposition
from ..schemas import (
    ErrorResponse,
    LimitsModel,
    SameHostResponse,
    StatsResponse,
    StatusResponse,
    StoreStatsModel,
    TenantFiguresModel,
    TenantStatsModel,
    as_json,
)
from .common import TenantDep, route
from .table import HEALTHZ, METRICS, READYZ, SAME_HOST, STATS


def router(core: RequestCore) -> APIRouter:
    d = core.d
    api = APIRouter(tags=["ops"])

    @route(api, HEALTHZ)
    async def healthz() -> StatusResponse:
        return StatusResponse(status="ok")

    @route(
        api,
        READYZ,
        responses={503: {"model": ErrorResponse, "description": "Starting or shutting down."}},
    )
    async def readyz() -> Response:
        if not d.ready:
            return error(503, "not_ready", "the daemon is starting or shutting down")
        # A tier that is down (a hung Redis) makes its chunks misses, not the daemon
        # unready: it still serves the other tiers. The body names it.
        down = {t.name: f.down_reason for t in d.store.tiers if not (f := t.faults()).up}
        if down:
            return JSONResponse({"status": "degraded", "tiers_down": down})
        return JSONResponse({"status": "ready"})

    @route(
        api,
        METRICS,
        response_class=Response,
        responses={200: {"content": {"text/plain": {"schema": {"type": "string"}}}}},
    )
    async def metrics(_: TenantDep) -> Response:
        lines = d.metrics.exposition() + d.tenants.exposition() + store_exposition(d.store.stats())
        lines += tenant_figures_exposition(d.store.tenant_figures())
        if d.same_host is not None:
            lines += d.same_host.metrics.exposition()
        lines += [
            "# HELP kvtier_service_ready 1 while the daemon serves requests.",
            "# TYPE kvtier_service_ready gauge",
            f"kvtier_service_ready {int(d.ready)}",
        ]
        return Response(
            "\n".join(lines) + "\n", media_type="text/plain; version=0.0.4; charset=utf-8"
        )

    @route(api, SAME_HOST)
    async def same_host(_: TenantDep) -> SameHostResponse:
        return SameHostResponse(
            socket=str(d.same_host.path) if d.same_host is not None else None,
            version=1,
        )

    @route(api, STATS)
    async def stats(t: TenantDep) -> StatsResponse:
        return StatsResponse(
            tenant=TenantStatsModel.model_validate({"name": t.label, **d.tenants.of(t.name)}),
            store=StoreStatsModel.model_validate(as_json(d.store.stats())),
            limits=LimitsModel.model_validate(as_json(d.limits)),
            tenants=[
                TenantFiguresModel.model_validate(as_json(f)) for f in d.store.tenant_figures()
            ],
        )

    return api
