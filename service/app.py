"""The daemon's FastAPI application: one tiered store behind API v1.

:func:`create_app` builds the store from the configuration and returns the ASGI app;
``kvtier serve`` (:mod:`kvtier.service.server`) runs it under uvicorn. Routes are
``async`` and never block the event loop on bytes: the store moves them on its own I/O
threads and the routes await its futures.

Every request is served for one tenant (:mod:`kvtier.service.tenants`); keys are mapped
into that tenant's key space before the store sees them. Every refusal is a 4xx with an
:class:`~kvtier.service.schemas.ErrorResponse` body; no input yields a 5xx.
"""

from __future__ import annotations

import asyncio
import logging
import re
from collections.abc import AsyncIterator, Awaitable
from contextlib import asynccontextmanager
from dataclasses import asdict, dataclass
from pathlib import Path as FsPath
from typing import Annotated, Any

import numpy as np
from fastapi import Depends, FastAPI, Path, Request, Security
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, Response
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from kvtier.config import KVTierConfig
from kvtier.errors import ClosedError, ConfigError, InputError
from kvtier.factory import Built, build_store
from kvtier.keys import ChunkKey
from kvtier.store.store import TieredStore
from kvtier.store.types import PutResult

from . import wire
from .fastpath import FastPath
from .metrics import (
    MetricsMiddleware,
    RequestMetrics,
    TenantCounters,
    store_exposition,
)
from .schemas import (
    KEY_PATTERN,
    DeleteResponse,
    ErrorResponse,
    KeysRequest,
    LimitsModel,
    LookupResponse,
    PutResponse,
    StatsResponse,
    StatusResponse,
    StoreStatsModel,
    TenantStatsModel,
    TierStatsModel,
)
from .tenants import Authenticator, KeyMapper, Tenant, load_or_create_salt

log = logging.getLogger(__name__)

API_VERSION = "1.0.0"
OCTET = wire.MEDIA_TYPE
_KEY_RE = re.compile(KEY_PATTERN)


class ApiError(StarletteHTTPException):
    """A refusal with a machine-readable code. Subclasses HTTPException so FastAPI's own
    body parsing lets it through unchanged."""

    def __init__(self, status: int, code: str, message: str, headers: dict[str, str] | None = None):
        super().__init__(status, message, headers)
        self.code = code


@dataclass(frozen=True, slots=True)
class Limits:
    """Enforced limits, in bytes and keys."""

    max_value_bytes: int
    max_body_bytes: int
    max_batch_keys: int


class Daemon:
    """What the routes share: the store, tenants, limits and counters.

    Args:
        built: the store (owned: closed on shutdown) and its spec.
        cfg: the configuration (its ``service`` section).
    """

    def __init__(self, built: Built, cfg: KVTierConfig) -> None:
        s = cfg.service
        self.store: TieredStore = built.store
        max_value = s.max_value_bytes or built.spec.chunk_bytes(cfg.store.chunk_tokens)
        max_value = min(max_value, self.store.slot_bytes)
        if s.max_body_bytes < max_value + wire.table_bytes(1):
            raise ConfigError(
                "service.max_body_bytes",
                s.max_body_bytes,
                f"at least one value plus its batch header ({max_value + wire.table_bytes(1)} B)",
            )
        self.limits = Limits(max_value, s.max_body_bytes, s.max_batch_keys)
        self.auth = Authenticator(s.tokens)
        salt = s.key_salt
        if not salt and s.data_dir:
            salt = load_or_create_salt(FsPath(s.data_dir).expanduser() / "key_salt")
        self.mapper = KeyMapper(salt)
        self.metrics = RequestMetrics()
        self.tenants = TenantCounters()
        self.ready = False
        if self.mapper.random_salt and self.store.stats().chunks:
            log.warning(
                "service.key_salt is empty: the %d chunks recovered at start-up are unreachable",
                self.store.stats().chunks,
            )

    def keys(self, tenant: Tenant, hex_keys: list[str]) -> list[ChunkKey]:
        if len(hex_keys) > self.limits.max_batch_keys:
            raise ApiError(
                413,
                "batch_too_large",
                f"{len(hex_keys)} keys; the limit is {self.limits.max_batch_keys} "
                "(service.max_batch_keys)",
            )
        out: list[ChunkKey] = self.mapper.map(
            tenant, (ChunkKey(bytes.fromhex(k)) for k in hex_keys)
        )
        return out

    async def put_value(self, t: Tenant, hex_key: str, value: bytes | memoryview) -> PutResult:
        """Store one value for tenant ``t`` (the shared logic of both PUT paths)."""
        if not len(value):
            raise ApiError(400, "empty_value", "a value of 0 bytes cannot be stored")
        res: PutResult = await asyncio.wrap_future(self.store.put([self.key(t, hex_key)], value))
        self.tenants.add(t.name, put_chunks=res.stored, put_bytes=len(value) * res.stored)
        return res

    async def get_value(self, t: Tenant, hex_key: str) -> memoryview | None:
        """One value for tenant ``t``, or None (the shared logic of both GET paths)."""
        buf = np.empty(self.limits.max_value_bytes, dtype=np.uint8)
        res = await asyncio.wrap_future(self.store.get([self.key(t, hex_key)], buf))
        if not res.chunks:
            self.tenants.add(t.name, lookup_miss_chunks=1)
            return None
        self.tenants.add(t.name, get_chunks=1, get_bytes=res.nbytes)
        return buf.data[: res.nbytes]

    def key(self, tenant: Tenant, hex_key: str) -> ChunkKey:
        if not _KEY_RE.match(hex_key):  # routes validate too; this guards direct callers
            raise ApiError(400, "bad_key", f"key {hex_key[:40]!r} is not 32 hex digits")
        (out,) = self.mapper.map(tenant, (ChunkKey(bytes.fromhex(hex_key)),))
        return ChunkKey(out)


def _error(
    status: int, code: str, message: str, headers: dict[str, str] | None = None
) -> JSONResponse:
    return JSONResponse(
        ErrorResponse(code=code, message=message).model_dump(), status, headers=headers
    )


_STATUS_CODES = {
    400: "bad_request",
    401: "unauthorized",
    403: "forbidden",
    404: "not_found",
    405: "method_not_allowed",
    413: "body_too_large",
    415: "unsupported_media_type",
    422: "invalid_request",
    503: "unavailable",
}


class BodyLimit:
    """Pure ASGI guard: refuses bodies over ``limit`` bytes before any route reads them.

    A declared Content-Length over the limit is refused at once; a chunked body is
    counted as it arrives and refused when it crosses the limit.
    """

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
                    resp = _error(
                        413,
                        "body_too_large",
                        f"body of {declared} B; the limit is {self.limit} B "
                        "(service.max_body_bytes)",
                    )
                    await resp(scope, receive, send)
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


def _put_response(results: list[PutResult]) -> PutResponse:
    return PutResponse(
        stored=sum(r.stored for r in results),
        present=sum(r.present for r in results),
        rejected=sum(r.rejected for r in results),
        failed=sum(r.failed for r in results),
    )


_BINARY_BODY = {"content": {OCTET: {"schema": {"type": "string", "format": "binary"}}}}
_ERRORS: dict[int | str, dict[str, Any]] = {
    code: {"model": ErrorResponse, "description": desc}
    for code, desc in (
        (400, "Malformed input (bad key, bad batch body)."),
        (401, "Missing or unknown bearer token."),
        (413, "Body, value or batch over a limit."),
        (422, "A parameter or JSON body that fails validation."),
    )
}


_bearer = HTTPBearer(auto_error=False, description="A token from [service.tokens].")


def _tenant(
    request: Request, cred: Annotated[HTTPAuthorizationCredentials | None, Security(_bearer)]
) -> Tenant:
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


def create_app(cfg: KVTierConfig, *, built: Built | None = None) -> FastAPI:
    """The daemon's ASGI app over a store built from ``cfg`` (or ``built``).

    The app owns the store: its lifespan shutdown flushes and closes it.

    Raises:
        ConfigError: limits that contradict each other, or a store that cannot be built.
    """
    s = cfg.service
    if built is None:
        max_value = s.max_value_bytes or None
        built = build_store(cfg, chunk_bytes=max_value)
    d = Daemon(built, cfg)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
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
            log.info("kvtier daemon shutting down: flushing and closing the store")
            await asyncio.to_thread(d.store.close)
            log.info("kvtier daemon: store closed")

    app = FastAPI(
        title="kvtier daemon",
        version=API_VERSION,
        summary="A tiered KV-cache store over REST.",
        description=_DESCRIPTION,
        lifespan=lifespan,
        responses=_ERRORS,
    )
    app.state.daemon = d

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = (
            exc.code if isinstance(exc, ApiError) else _STATUS_CODES.get(exc.status_code, "error")
        )
        status = exc.status_code if 400 <= exc.status_code < 500 or exc.status_code == 503 else 400
        return _error(status, code, str(exc.detail), dict(exc.headers or {}))

    @app.exception_handler(RequestValidationError)
    async def validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        parts = []
        for e in exc.errors()[:5]:
            loc = ".".join(str(x) for x in e.get("loc", ()))
            parts.append(f"{loc}: {e.get('msg', 'invalid')}")
        return _error(422, "invalid_request", "; ".join(parts) or "invalid request")

    @app.exception_handler(InputError)
    async def input_error(_: Request, exc: InputError) -> JSONResponse:
        return _error(400, "bad_input", str(exc))

    @app.exception_handler(ClosedError)
    async def closed_error(_: Request, exc: ClosedError) -> JSONResponse:
        return _error(503, "shutting_down", "the daemon is shutting down; retry on another one")

    async def wait(fut: Any) -> Any:
        return await asyncio.wrap_future(fut)

    # -- health and observability ----------------------------------------------------------

    @app.get("/healthz", tags=["ops"], summary="Liveness: the process answers.")
    async def healthz() -> StatusResponse:
        return StatusResponse(status="ok")

    @app.get(
        "/readyz",
        tags=["ops"],
        summary="Readiness: the store is open and serving.",
        responses={503: {"model": ErrorResponse, "description": "Starting or shutting down."}},
    )
    async def readyz() -> Response:
        if not d.ready:
            return _error(503, "not_ready", "the daemon is starting or shutting down")
        return JSONResponse({"status": "ready"})

    @app.get(
        "/metrics",
        tags=["ops"],
        summary="Prometheus metrics (text exposition format 0.0.4).",
        response_class=Response,
        responses={200: {"content": {"text/plain": {"schema": {"type": "string"}}}}},
    )
    async def metrics(_: TenantDep) -> Response:
        lines = d.metrics.exposition() + d.tenants.exposition() + store_exposition(d.store.stats())
        lines += [
            "# HELP kvtier_service_ready 1 while the daemon serves requests.",
            "# TYPE kvtier_service_ready gauge",
            f"kvtier_service_ready {int(d.ready)}",
        ]
        return Response(
            "\n".join(lines) + "\n", media_type="text/plain; version=0.0.4; charset=utf-8"
        )

    @app.get(
        "/v1/stats", tags=["ops"], summary="Store counters, the caller's own counters, limits."
    )
    async def stats(t: TenantDep) -> StatsResponse:
        st = d.store.stats()
        raw = asdict(st)
        raw["tier_hits"] = dict(st.tier_hits)
        raw["tiers"] = [TierStatsModel(**asdict(x)) for x in st.tiers]
        return StatsResponse(
            tenant=TenantStatsModel(name=t.label, **d.tenants.of(t.name)),
            store=StoreStatsModel(**raw),
            limits=LimitsModel(**asdict(d.limits)),
        )

    # -- single chunks ----------------------------------------------------------------------

    @app.put(
        "/v1/chunks/{key}",
        tags=["chunks"],
        summary="Store one value (write-once: a present key is left as it is).",
        openapi_extra={"requestBody": {"required": True, **_BINARY_BODY}},
    )
    async def put_chunk(key: KeyPath, request: Request, t: TenantDep) -> PutResponse:
        body = await read_body(request, d.limits.max_value_bytes, "value")
        return _put_response([await d.put_value(t, key, body)])

    @app.get(
        "/v1/chunks/{key}",
        tags=["chunks"],
        summary="Read one value.",
        response_class=Response,
        responses={
            200: {"description": "The value's bytes.", **_BINARY_BODY},
            404: {"model": ErrorResponse, "description": "Not present (for this tenant)."},
        },
    )
    async def get_chunk(key: KeyPath, t: TenantDep) -> Response:
        value = await d.get_value(t, key)
        if value is None:
            return _error(404, "not_found", f"key {key} is not present")
        return Response(value, media_type=OCTET)

    @app.head(
        "/v1/chunks/{key}",
        tags=["chunks"],
        summary="Whether a key is present (200) or not (404); no body.",
        response_class=Response,
        responses={200: {"description": "Present."}, 404: {"description": "Not present."}},
    )
    async def head_chunk(key: KeyPath, t: TenantDep) -> Response:
        hit = d.store.lookup([d.key(t, key)]).hits
        d.tenants.add(t.name, lookup_hit_chunks=hit, lookup_miss_chunks=1 - hit)
        return Response(status_code=200 if hit else 404)

    @app.delete("/v1/chunks/{key}", tags=["chunks"], summary="Remove one key (idempotent).")
    async def delete_chunk(key: KeyPath, t: TenantDep) -> DeleteResponse:
        return DeleteResponse(deleted=d.store.delete([d.key(t, key)]))

    # -- batches ------------------------------------------------------------------------------

    @app.post(
        "/v1/lookup",
        tags=["batch"],
        summary="Length of the leading run of present keys, and the tier of each hit.",
    )
    async def lookup(req: KeysRequest, t: TenantDep) -> LookupResponse:
        res = d.store.lookup(d.keys(t, req.keys))
        d.tenants.add(
            t.name, lookup_hit_chunks=res.hits, lookup_miss_chunks=len(req.keys) - res.hits
        )
        return LookupResponse(hits=res.hits, tiers=list(res.tiers))

    @app.post(
        "/v1/batch/get",
        tags=["batch"],
        summary="Read the leading run of present keys as one batch body (see the description).",
        response_class=Response,
        responses={
            200: {"description": "A batch body (KVTB format) of the leading hits.", **_BINARY_BODY}
        },
    )
    async def batch_get(req: KeysRequest, t: TenantDep) -> Response:
        ikeys = d.keys(t, req.keys)
        hits = d.store.lookup(ikeys).hits
        lim = d.limits
        # The response is capped at max_body_bytes; the TRUNCATED flag says more may follow.
        fit = max(1, (lim.max_body_bytes - wire.table_bytes(hits)) // lim.max_value_bytes)
        n = min(hits, fit)
        start = wire.table_bytes(n)
        buf = np.empty(start + n * lim.max_value_bytes, dtype=np.uint8)
        view = buf.data
        if n:
            res = await wait(d.store.get(ikeys[:n], view[start:]))
            chunks, nbytes, lengths = res.chunks, res.nbytes, res.value_bytes
        else:
            chunks, nbytes, lengths = 0, 0, ()
        # Keys evicted between lookup and get shorten the run; the table then has gaps
        # before the payload, which payload_offset allows.
        flags = wire.FLAG_TRUNCATED if chunks == n < hits else 0
        wire.write_header(view, chunks, start, flags)
        wire.write_table(view, [ChunkKey(bytes.fromhex(k)) for k in req.keys[:chunks]], lengths)
        d.tenants.add(
            t.name,
            get_chunks=chunks,
            get_bytes=nbytes,
            lookup_hit_chunks=chunks,
            lookup_miss_chunks=len(req.keys) - chunks,
        )
        return Response(view[: start + nbytes], media_type=OCTET)

    @app.post(
        "/v1/batch/put",
        tags=["batch"],
        summary="Store many values sent as one batch body (see the description).",
        openapi_extra={"requestBody": {"required": True, **_BINARY_BODY}},
    )
    async def batch_put(request: Request, t: TenantDep) -> PutResponse:
        body = await read_body(request, d.limits.max_body_bytes, "batch body")
        try:
            batch = wire.parse(
                body, max_count=d.limits.max_batch_keys, max_value_bytes=d.limits.max_value_bytes
            )
        except InputError as exc:
            raise ApiError(400, "bad_batch", str(exc)) from None
        if len(set(batch.keys)) != len(batch.keys):
            raise ApiError(400, "duplicate_key", "a batch names the same key twice")
        ikeys = d.mapper.map(t, batch.keys)
        runs = wire.runs(batch)
        futs: list[Awaitable[PutResult]] = [
            wait(d.store.put(ikeys[r.start : r.start + r.count], r.data)) for r in runs
        ]
        results = list(await asyncio.gather(*futs))
        stored_bytes = sum(res.stored * r.value_bytes for res, r in zip(results, runs, strict=True))
        out = _put_response(results)
        d.tenants.add(t.name, put_chunks=out.stored, put_bytes=stored_bytes)
        return out

    _document(app)
    return _wrap(app, d)


def _wrap(app: FastAPI, d: Daemon) -> FastAPI:
    # Added innermost first: metrics see every request, including those BodyLimit refuses
    # and those the fast path answers.
    app.add_middleware(FastPath, daemon=d)  # type: ignore[arg-type]
    app.add_middleware(BodyLimit, limit=d.limits.max_body_bytes)  # type: ignore[arg-type]
    app.add_middleware(MetricsMiddleware, metrics=d.metrics)  # type: ignore[arg-type]
    return app


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
