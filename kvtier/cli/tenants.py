"""``kvtier tenants``: a running daemon's per-tenant, per-tier figures, as a table or JSON.

Reads ``/v1/stats`` (its ``tenants`` list) with the daemon's Python client, over HTTP or
HTTPS (``--ca-file`` to verify a daemon's own certificate); any tenant's token may read
every tenant's figures, as ``/metrics`` shows them.
"""

from __future__ import annotations

import json
from typing import Any

from rich.console import Console
from rich.table import Table

from kvtier.cli.console import stdout_console
from kvtier.errors import ConfigError
from kvtier.service.client import Client
from kvtier.units import format_size


def fetch(url: str, token: str | None, ca_file: str | None, timeout_s: float) -> list[Any]:
    """The daemon's ``tenants`` figures (a list of TenantFigures as JSON).

    Raises:
        TransportError: the daemon cannot be reached; AuthError: the token is refused.
        ConfigError: the daemon's answer has no per-tenant figures (an older daemon).
    """
    with Client(url, token, timeout_s=timeout_s, same_host=False, ca_file=ca_file) as c:
        stats = c.stats()
    figures = stats.get("tenants")
    if not isinstance(figures, list):
        raise ConfigError("--url", url, "a kvtier daemon that reports per-tenant figures")
    return figures


def _size(n: int | None) -> str:
    return "unlimited" if n is None else format_size(n)


def table(figures: list[Any]) -> Table:
    """One row per tenant and tier; the tenant's lookup misses on its first row."""
    t = Table(title="per-tenant figures (counters since the daemon started)")
    t.add_column("tenant")
    t.add_column("tier")
    for name in ("lookup hits", "lookup misses", "reads", "read bytes", "stored", "stored bytes"):
        t.add_column(name, justify="right")
    for name in ("evicted", "quota used", "quota"):
        t.add_column(name, justify="right")
    for f in figures:
        for i, tier in enumerate(f["tiers"]):
            t.add_row(
                f["tenant"] if i == 0 else "",
                tier["tier"],
                str(tier["lookup_hit_chunks"]),
                str(f["lookup_miss_chunks"]) if i == 0 else "",
                str(tier["read_chunks"]),
                format_size(tier["read_bytes"]),
                str(tier["stored_chunks"]),
                format_size(tier["stored_bytes"]),
                str(tier["evicted_chunks"]),
                format_size(tier["quota_used_bytes"]),
                _size(tier["quota_limit_bytes"]),
            )
    return t


def run_tenants(
    url: str, token: str | None, ca_file: str | None, *, as_json: bool, timeout_s: float
) -> int:
    """Print the figures; exit status 0, or 1 when the daemon keeps none (no [tenants])."""
    figures = fetch(url, token, ca_file, timeout_s)
    console = stdout_console()
    if as_json:
        print(json.dumps(figures, indent=2))
    elif figures:
        console.print(table(figures))
    if not figures:
        Console(stderr=True).print(
            "the daemon keeps no per-tenant figures: they need a [tenants] section "
            "(docs/operations.md, 'Multi-tenant deployment')",
            soft_wrap=True,
            highlight=False,
            markup=False,
        )
        return 1
    return 0
