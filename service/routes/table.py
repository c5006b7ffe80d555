"""The daemon's routes, one table: each route's method, path template, summary and the
rules the request core applies to it (who may call it, which limit bounds its body).

Every part of the service reads routes from here: the FastAPI routers
(:mod:`kvtier.service.routes`), the request core (:mod:`kvtier.service.core`), the
data-plane front end (:mod:`kvtier.service.dataplane`), the request metrics (their
``route`` label is the template) and the client's operations
(:mod:`kvtier.service.protocol`). Imports nothing of the web framework, so the client
can use it without the ``service`` extra's server side.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from enum import Enum

KEY_PATTERN = r"^[0-9a-fA-F]{32}$"
"""A chunk key on the wire: 32 hex digits (16 bytes)."""


class BodyLimit(Enum):
    """Which limit bounds a route's request body (the gate refuses more with 413)."""

    VALUE = "service.max_value_bytes"
    BATCH = "service.max_body_bytes"
    KEYS = "service.max_batch_keys"  # a JSON list of keys


@dataclass(frozen=True, slots=True)
class Route:
    """One route of API v1.

    Attributes:
        method: the HTTP method.
        template: the path, with ``{key}`` where a chunk key goes.
        summary: one line for the OpenAPI document.
        protected: a bearer token is required (when the daemon has tokens).
        body: the limit on its request body.
    """

    method: str
    template: str
    summary: str
    protected: bool = True
    body: BodyLimit = BodyLimit.KEYS

    def path(self, key: str = "") -> str:
        """The request path (``key``: 32 hex digits, for a chunk route)."""
        return self.template.replace("{key}", key) if key else self.template


_CHUNK = "/v1/chunks/{key}"

HEALTHZ = Route("GET", "/healthz", "Liveness: the process answers.", protected=False)
READYZ = Route("GET", "/readyz", "Readiness: the store is open and serving.", protected=False)
METRICS = Route("GET", "/metrics", "Prometheus metrics (text exposition format 0.0.4).")
SAME_HOST = Route(
    "GET",
    "/v1/same-host",
    "The same-host channel (shared memory) for clients on this machine, if on.",
)
STATS = Route("GET", "/v1/stats", "Store counters, the caller's own counters, limits.")
PUT_CHUNK = Route(
    "PUT",
    _CHUNK,
    "Store one value (write-once: a present key is left as it is).",
    body=BodyLimit.VALUE,
)
GET_CHUNK = Route("GET", _CHUNK, "Read one value.")
HEAD_CHUNK = Route("HEAD", _CHUNK, "Whether a key is present (200) or not (404); no body.")
DELETE_CHUNK = Route("DELETE", _CHUNK, "Remove one key (idempotent).")
LOOKUP = Route(
    "POST", "/v1/lookup", "Length of the leading run of present keys, and the tier of each hit."
)
BATCH_GET = Route(
    "POST",
    "/v1/batch/get",
    "Read the leading run of present keys as one batch body (see the description).",
)
BATCH_PUT = Route(
    "POST",
    "/v1/batch/put",
    "Store many values sent as one batch body (see the description).",
    body=BodyLimit.BATCH,
)

ROUTES = (
    HEALTHZ,
    READYZ,
    METRICS,
    SAME_HOST,
    STATS,
    PUT_CHUNK,
    GET_CHUNK,
    HEAD_CHUNK,
    DELETE_CHUNK,
    LOOKUP,
    BATCH_GET,
    BATCH_PUT,
)
CHUNK_TEMPLATE = _CHUNK
"""The template of the one-chunk routes (their metrics label)."""

_CHUNK_PREFIX = _CHUNK.removesuffix("{key}")
_CHUNK_URL = re.compile(re.escape(_CHUNK_PREFIX) + "([0-9a-fA-F]{32})")
_CHUNK_URL_BYTES = re.compile(re.escape(_CHUNK_PREFIX.encode()) + b"([0-9a-fA-F]{32})")
_BY_PATH = {(r.method, r.template): r for r in ROUTES}
_PROTECTED = frozenset(r.template for r in ROUTES if r.protected)


def chunk_key(path: str) -> str | None:
    """The key of a one-chunk path (``/v1/chunks/<32 hex>``), or None."""
    m = _CHUNK_URL.fullmatch(path)
    return m.group(1) if m else None


def chunk_key_of_url(url: bytes) -> str | None:
    """:func:`chunk_key` of a raw request target (no query string allowed)."""
    m = _CHUNK_URL_BYTES.fullmatch(url)
    return m.group(1).decode("ascii") if m else None


def route_of(method: str, path: str) -> Route | None:
    """The route a request names, or None (a path or method the API does not have)."""
    if path.startswith(_CHUNK_PREFIX):
        return _BY_PATH.get((method, _CHUNK)) if "/" not in path[len(_CHUNK_PREFIX) :] else None
    return _BY_PATH.get((method, path))


def protected(path: str) -> bool:
    """Whether a path needs a token: every API route but the probes, and any path
    under ``/v1/`` (so an unknown one answers 401 before 404 to an anonymous client)."""
    return path.startswith("/v1/") or path in _PROTECTED
