"""The daemon's FastAPI application: one tiered store behind API v1.

:func:`create_app` builds the store from the configuration and returns the ASGI app;
``kvtier serve`` (:mod:`kvtier.service.server`) runs it under uvicorn. The parts:

* :mod:`.daemon`: the state every front end shares (store, tenants, limits, counters);
* :mod:`.core`: the request core every front end calls (admission, one chunk, metrics);
* :mod:`.routes`: the routes (their table, :mod:`.routes.table`), one module per area;
* :mod:`.errors`: the one mapping from errors to answers;
* :mod:`.guards`, :mod:`.metrics`: pure-ASGI layers around the routes.

In front of the app, the data-plane front end (:mod:`.dataplane`, uvicorn's ``http``
protocol) answers most one-chunk GETs and PUTs through the same core; the same-host
channel (:mod:`.shm`) serves clients on this machine, through the same core too.

Routes are ``async`` and never block the event loop on bytes: the store moves them on
its own I/O threads and the routes await its futures. Every request is served for one
tenant (:mod:`kvtier.service.tenants`); keys are mapped into that tenant's key space
before the store sees them. Every refusal is a 4xx (or a retryable 503) with an
:class:`~kvtier.service.schemas.ErrorResponse` body; no input yields a 500.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

from kvtier.config import KVTierConfig
from kvtier.factory import Built, build_store

from . import errors, wire
from .core import RequestCore
from .daemon import Daemon
from .guards import Gate
from .metrics import MetricsMiddleware
from .routes import batch, chunks, ops
from .schemas import ErrorResponse
from .shm import SameHostServer

log = logging.getLogger(__name__)

API_VERSION = "1.0.0"

_ERRORS: dict[int | str, dict[str, Any]] = {
    code: {"model": ErrorResponse, "description": desc}
    for code, desc in (
        (400, "Malformed input (bad key, bad batch body)."),
        (401, "Missing or unknown bearer token."),
        (413, "Body, value or batch over a limit."),
        (422, "A parameter or JSON body that fails validation."),
    )
}


def create_app(cfg: KVTierConfig, *, built: Built | None = None) -> FastAPI:
    """The daemon's ASGI app over a store built from ``cfg`` (or ``built``).

    The app owns the store: its lifespan shutdown flushes and closes it.

    Raises:
        ConfigError: limits that contradict each other, or a store that cannot be built.
    """
    if built is None:
        built = build_store(cfg, chunk_bytes=cfg.service.max_value_bytes or None)
    d = Daemon(built, cfg)
    core = RequestCore(d)
    app = FastAPI(
        title="kvtier daemon",
        version=API_VERSION,
        summary="A tiered KV-cache store over REST.",
        description=_DESCRIPTION,
        lifespan=_lifespan(core, cfg),
        responses=_ERRORS,
    )
    app.state.daemon = d
    app.state.core = core
    errors.install(app)
    for area in (ops, chunks, batch):
        app.include_router(area.router(core))
    _document(app)
    # Added innermost first: metrics see every request, including those the gate refuses.
    app.add_middleware(Gate, core=core)  # type: ignore[arg-type]
    app.add_middleware(MetricsMiddleware, metrics=d.metrics)  # type: ignore[arg-type]
    return app


def _lifespan(core: RequestCore, cfg: KVTierConfig) -> Any:
    s = cfg.service
    d = core.d

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        d.same_host = SameHostServer.start(
            core, s.socket, s.socket_max_region_bytes, s.socket_auth_timeout_s
        )
        d.ready = True
        log.info(
            "kvtier daemon ready: %d tier(s), values up to %d B, %s",
            len(d.store.tiers),
            d.limits.max_value_bytes,
            f"{len(s.tokens)} tenant token(s)" if s.tokens else "no authentication (loopback)",
        )
        try:
            yield
        finally:
            d.ready = False
            if d.same_host is not None:
                # Its requests in progress finish before the store closes under them.
                await asyncio.to_thread(d.same_host.close, s.shutdown_timeout_s)
            log.info("kvtier daemon shutting down: flushing and closing the store")
            await asyncio.to_thread(d.close)
            log.info("kvtier daemon: store closed")

    return lifespan


def _document(app: FastAPI) -> None:
    """Cache the OpenAPI document once, with the batch format in it."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = get_openapi(
                title=app.title,
                version=app.version,
                summary=app.summary,
                description=app.description,
                routes=app.routes,
            )
            schema.setdefault("components", {})["x-kvtier-batch-format"] = {
                "description": wire.__doc__,
                "magic": wire.MAGIC.decode(),
                "version": wire.VERSION,
                "header_bytes": wire.HEADER_BYTES,
                "entry_bytes": wire.ENTRY_BYTES,
            }
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]


_DESCRIPTION = (
    "A tiered KV-cache store (host DRAM, CXL, NVMe, Redis) for LLM inference.\n\n"
    "**Keys** are 16 bytes written as 32 hex digits. Every key lives in the namespace of "
    "the tenant whose bearer token sent it; no tenant can read or probe another's keys.\n\n"
    "**Values** are raw bytes (`application/octet-stream`), 1 byte to `limits.max_value_bytes` "
    "(see `/v1/stats`). Keys are write-once: a put of a present key changes nothing.\n\n"
    "**Batch body format** (`POST /v1/batch/put` request, `POST /v1/batch/get` response):\n\n"
    + "\n".join("    " + line for line in (wire.__doc__ or "").splitlines())
)
