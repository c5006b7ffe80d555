"""Health, readiness, Prometheus metrics and stats."""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import JSONResponse, Response

from ..daemon import Daemon
from ..errors import error
from ..metrics import store_exposition
from ..schemas import (
    ErrorResponse,
    LimitsModel,
    SameHostResponse,
    StatsResponse,
    StatusResponse,
    StoreStatsModel,
    TenantStatsModel,
    as_json,
)
from .common import TenantDep


def router(d: Daemon) -> APIRouter:
    api = APIRouter(tags=["ops"])

    @api.get("/healthz", summary="Liveness: the process answers.")
    async def healthz() -> StatusResponse:
        return StatusResponse(status="ok")

    @api.get(
        "/readyz",
        summary="Readiness: the store is open and serving.",
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

    @api.get(
        "/metrics",
        summary="Prometheus metrics (text exposition format 0.0.4).",
        response_class=Response,
        responses={200: {"content": {"text/plain": {"schema": {"type": "string"}}}}},
    )
    async def metrics(_: TenantDep) -> Response:
        lines = d.metrics.exposition() + d.tenants.exposition() + store_exposition(d.store.stats())
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

    @api.get(
        "/v1/same-host",
        summary="The same-host channel (shared memory) for clients on this machine, if on.",
    )
    async def same_host(_: TenantDep) -> SameHostResponse:
        return SameHostResponse(
            socket=str(d.same_host.path) if d.same_host is not None else None,
            version=1,
        )

    @api.get("/v1/stats", summary="Store counters, the caller's own counters, limits.")
    async def stats(t: TenantDep) -> StatsResponse:
        return StatsResponse(
            tenant=TenantStatsModel.model_validate({"name": t.label, **d.tenants.of(t.name)}),
            store=StoreStatsModel.model_validate(as_json(d.store.stats())),
            limits=LimitsModel.model_validate(as_json(d.limits)),
        )

    return api
