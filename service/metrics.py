"""Request metrics and the Prometheus text exposition (format 0.0.4), written by hand.

Labels are bounded on purpose: the route *template* (never the raw path, which a
client controls), the method, the status code and the tenant name (from the config).
A fuzzer sending a million odd paths adds one series, ``route="other"``.
"""

from __future__ import annotations

import bisect
import threading
import time
from collections.abc import Iterable, Sequence
from dataclasses import fields
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from kvtier.store.quota import TenantFigures
from kvtier.store.types import PolicyCount, StoreStats

# Request latency buckets, in seconds: 100 µs to 10 s.
BUCKETS_S = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0, 10.0)

_METHODS = frozenset({"GET", "HEAD", "PUT", "POST", "DELETE", "OPTIONS", "PATCH"})

# StoreStats fields that only grow; the rest are gauges.
_STORE_GAUGES = {"chunks"}


class RequestMetrics:
    """Counters and latency histograms per (route, method, status). Thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._count: dict[tuple[str, str, int], int] = {}
        self._hist: dict[tuple[str, str], list[int]] = {}
        self._sum_s: dict[tuple[str, str], float] = {}
        self._bytes_in: dict[str, int] = {}
        self._bytes_out: dict[str, int] = {}
        self.in_flight = 0
        # Requests answered in the HTTP protocol, below ASGI (service/dataplane.py).
        # Counted on the event loop only, as in_flight is.
        self.direct = 0

    def observe(
        self, route: str, method: str, status: int, seconds: float, nin: int, nout: int
    ) -> None:
        with self._lock:
            key = (route, method, status)
            self._count[key] = self._count.get(key, 0) + 1
            hk = (route, method)
            hist = self._hist.get(hk)
            if hist is None:
                hist = self._hist[hk] = [0] * (len(BUCKETS_S) + 1)
                self._sum_s[hk] = 0.0
            hist[bisect.bisect_left(BUCKETS_S, seconds)] += 1
            self._sum_s[hk] += seconds
            self._bytes_in[route] = self._bytes_in.get(route, 0) + nin
            self._bytes_out[route] = self._bytes_out.get(route, 0) + nout

    def exposition(self) -> list[str]:
        with self._lock:
            count = dict(self._count)
            hist = {k: list(v) for k, v in self._hist.items()}
            sums = dict(self._sum_s)
            bin_, bout = dict(self._bytes_in), dict(self._bytes_out)
            in_flight, direct = self.in_flight, self.direct
        out = [
            "# HELP kvtier_http_requests_total HTTP requests by route template, method and status.",
            "# TYPE kvtier_http_requests_total counter",
        ]
        for (route, method, status), n in sorted(count.items()):
            out.append(
                "kvtier_http_requests_total"
                f'{{route="{route}",method="{method}",status="{status}"}} {n}'
            )
        out += [
            "# HELP kvtier_http_request_duration_seconds Request start to last byte sent.",
            "# TYPE kvtier_http_request_duration_seconds histogram",
        ]
        for (route, method), h in sorted(hist.items()):
            labels = f'route="{route}",method="{method}"'
            acc = 0
            for le, n in zip((*BUCKETS_S, float("inf")), h, strict=True):
                acc += n
                le_s = "+Inf" if le == float("inf") else repr(le)
                out.append(
                    f'kvtier_http_request_duration_seconds_bucket{{{labels},le="{le_s}"}} {acc}'
                )
            out.append(
                f"kvtier_http_request_duration_seconds_sum{{{labels}}} {sums[(route, method)]}"
            )
            out.append(f"kvtier_http_request_duration_seconds_count{{{labels}}} {acc}")
        for name, data, what in (
            ("kvtier_http_request_bytes_total", bin_, "Request body bytes received"),
            ("kvtier_http_response_bytes_total", bout, "Response body bytes sent"),
        ):
            out += [f"# HELP {name} {what}, by route template.", f"# TYPE {name} counter"]
            out += [f'{name}{{route="{r}"}} {n}' for r, n in sorted(data.items())]
        out += [
            "# HELP kvtier_http_requests_in_flight Requests being served now.",
            "# TYPE kvtier_http_requests_in_flight gauge",
            f"kvtier_http_requests_in_flight {in_flight}",
            "# HELP kvtier_http_direct_answers_total One-chunk GETs and PUTs answered in the"
            " HTTP protocol, below ASGI; also counted in kvtier_http_requests_total.",
            "# TYPE kvtier_http_direct_answers_total counter",
            f"kvtier_http_direct_answers_total {direct}",
        ]
        return out


class TenantCounters:
    """Per-tenant chunk counters (hits, misses, bytes). Thread-safe."""

    NAMES = (
        "lookup_hit_chunks",
        "lookup_miss_chunks",
        "get_chunks",
        "get_bytes",
        "put_chunks",
        "put_bytes",
    )

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._c: dict[str, dict[str, int]] = {}

    def add(self, tenant: str, **deltas: int) -> None:
        with self._lock:
            c = self._c.get(tenant)
            if c is None:
                c = self._c[tenant] = dict.fromkeys(self.NAMES, 0)
            for k, v in deltas.items():
                c[k] += v

    def of(self, tenant: str) -> dict[str, int]:
        with self._lock:
            return dict(self._c.get(tenant) or dict.fromkeys(self.NAMES, 0))

    def exposition(self) -> list[str]:
        with self._lock:
            snap = {t: dict(c) for t, c in self._c.items()}
        out: list[str] = []
        for name in self.NAMES:
            metric = f"kvtier_tenant_{name}_total"
            out += [
                f"# HELP {metric} Per-tenant {name.replace('_', ' ')}.",
                f"# TYPE {metric} counter",
            ]
            out += [f'{metric}{{tenant="{t}"}} {c[name]}' for t, c in sorted(snap.items())]
        return out


def store_exposition(stats: StoreStats) -> list[str]:
    """Store-wide and per-tier series from :class:`StoreStats`."""
    out: list[str] = []
    for f in fields(StoreStats):
        value: Any = getattr(stats, f.name)
        if not isinstance(value, int):
            continue
        gauge = f.name in _STORE_GAUGES
        metric = f"kvtier_store_{f.name}" + ("" if gauge else "_total")
        out += [
            f"# HELP {metric} TieredStore {f.name.replace('_', ' ')}.",
            f"# TYPE {metric} {'gauge' if gauge else 'counter'}",
            f"{metric} {value}",
        ]
    out += [
        "# HELP kvtier_store_tier_hits_total Chunks served, by tier.",
        "# TYPE kvtier_store_tier_hits_total counter",
    ]
    out += [f'kvtier_store_tier_hits_total{{tier="{t}"}} {n}' for t, n in stats.tier_hits]
    per_tier: Iterable[tuple[str, str, str]] = (
        ("capacity_bytes", "gauge", "Bytes the tier may hold"),
        ("used_bytes", "gauge", "Bytes allocated in the tier"),
        ("external_fragmentation", "gauge", "Free space not in the largest free extent (0..1)"),
        ("bytes_written", "counter", "Bytes written to the tier"),
        ("bytes_read", "counter", "Bytes read from the tier"),
        ("up", "gauge", "1 while the tier serves, 0 while it is down or hung (its chunks miss)"),
        ("io_errors", "counter", "Transfers that failed in the tier (EIO, ENOSPC, timeouts)"),
        ("corrupt_chunks", "counter", "Chunks that failed verification in the tier"),
    )
    for name, kind, what in per_tier:
        metric = f"kvtier_tier_{name}" + ("_total" if kind == "counter" else "")
        out += [f"# HELP {metric} {what}.", f"# TYPE {metric} {kind}"]
        out += [
            f'{metric}{{tier="{t.name}",kind="{t.kind}"}} {_number(getattr(t, name))}'
            for t in stats.tiers
        ]
    return out + placement_exposition(stats)


# The per-tenant, per-tier figures: (field of TierFigures, Prometheus type, help).
_TENANT_TIER = (
    ("lookup_hit_chunks", "counter", "Chunks lookups found in the tier"),
    ("read_chunks", "counter", "Chunks gets served from the tier"),
    ("read_bytes", "counter", "Value bytes gets served from the tier"),
    ("stored_chunks", "counter", "Chunks written into the tier (new values and moves into it)"),
    ("stored_bytes", "counter", "Value bytes written into the tier"),
    ("evicted_chunks", "counter", "Chunks that left the tier to make room (demoted or dropped)"),
    ("quota_used_bytes", "gauge", "Bytes the tenant's chunks take in the tier (a slot each)"),
    ("quota_limit_bytes", "gauge", "The tenant's byte quota in the tier (absent: unlimited)"),
)


def tenant_figures_exposition(figures: Sequence[TenantFigures]) -> list[str]:
    """Per-tenant, per-tier series of the store (none without ``[tenants]``). Labels:
    the tenants the configuration names and ``(other)`` (:mod:`kvtier.store.quota`)."""
    if not figures:
        return []
    metric = "kvtier_tenant_store_lookup_miss_chunks_total"
    out = [
        f"# HELP {metric} Chunks lookups asked for and no tier held, by tenant.",
        f"# TYPE {metric} counter",
    ]
    out += [f'{metric}{{tenant="{f.tenant}"}} {f.lookup_miss_chunks}' for f in figures]
    for name, kind, what in _TENANT_TIER:
        metric = f"kvtier_tenant_tier_{name}" + ("_total" if kind == "counter" else "")
        out += [f"# HELP {metric} {what}, by tenant.", f"# TYPE {metric} {kind}"]
        for f in figures:
            for t in f.tiers:
                value = getattr(t, name)
                if value is not None:
                    out.append(f'{metric}{{tenant="{f.tenant}",tier="{t.tier}"}} {value}')
    return out


def placement_exposition(stats: StoreStats) -> list[str]:
    """The placement policy's figures: one metric per name (its series together, as the
    format requires), a series per tier."""
    by_name: dict[str, list[PolicyCount]] = {}
    for c in stats.placement:
        by_name.setdefault(c.name, []).append(c)
    out: list[str] = []
    for name, counts in by_name.items():
        first = counts[0]
        metric = f"kvtier_placement_{name}" + ("" if first.gauge else "_total")
        kind = "gauge" if first.gauge else "counter"
        out += [f"# HELP {metric} {first.help or name}.", f"# TYPE {metric} {kind}"]
        for c in counts:
            labels = f'{{tier="{c.tier}"}}' if c.tier else ""
            out.append(f"{metric}{labels} {_number(c.value)}")
    return out


def _number(value: object) -> object:
    return int(value) if isinstance(value, bool) else value


class MetricsMiddleware:
    """Pure ASGI middleware: times every HTTP request and counts it by route template.

    Pure ASGI (not ``BaseHTTPMiddleware``) so it adds microseconds, not a task per
    request, and never buffers bodies.
    """

    def __init__(self, app: ASGIApp, metrics: RequestMetrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        t0 = time.perf_counter()
        # 499 (as nginx logs it): the client went away before any response started.
        status = 499
        nin = 0
        nout = 0

        async def counting_receive() -> Message:
            nonlocal nin
            msg = await receive()
            if msg["type"] == "http.request":
                nin += len(msg.get("body", b""))
            return msg

        async def counting_send(msg: Message) -> None:
            nonlocal status, nout
            if msg["type"] == "http.response.start":
                status = int(msg["status"])
            elif msg["type"] == "http.response.body":
                nout += len(msg.get("body", b""))
            await send(msg)

        self.metrics.in_flight += 1
        try:
            await self.app(scope, counting_receive, counting_send)
        except BaseException:
            if status == 499:
                status = 500  # Starlette's error middleware answers 500 outside us
            raise
        finally:
            self.metrics.in_flight -= 1
            route = scope.get("route")
            template = getattr(route, "path", None) or "other"
            method = scope.get("method", "?")
            self.metrics.observe(
                template,
                method if method in _METHODS else "other",
                status,
                time.perf_counter() - t0,
                nin,
                nout,
            )
