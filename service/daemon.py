"""The daemon's state, apart from its routes: the store, tenants, limits and counters.

:class:`Daemon` holds what every front end shares; the request core
(:mod:`kvtier.service.core`) runs the logic of every request over it. Here too: the
store calls that may block (lookup with a shared tier, delete), kept off the event loop.
"""

from __future__ import annotations

import asyncio
import logging
import re
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Protocol, TypeVar

from kvtier.config import KVTierConfig
from kvtier.errors import ConfigError
from kvtier.factory import Built
from kvtier.keys import ChunkKey
from kvtier.store.store import TieredStore
from kvtier.store.types import LookupResult
from kvtier.tiers.base import SharedTier

from . import wire
from .buffers import ValueBuffers
from .errors import ApiError
from .limits import Budget, Limits
from .metrics import RequestMetrics, TenantCounters
from .routes.table import KEY_PATTERN
from .tenants import Authenticator, KeyMapper, Tenant, load_or_create_salt

log = logging.getLogger(__name__)

_KEY_RE = re.compile(KEY_PATTERN)


class Exposition(Protocol):
    def exposition(self) -> list[str]:
        """Prometheus text lines."""
        ...


class SideChannel(Protocol):
    """What the daemon's state and routes use of its same-host channel
    (:class:`~kvtier.service.shm.SameHostServer`, which imports this module)."""

    @property
    def path(self) -> Path: ...

    @property
    def metrics(self) -> Exposition: ...

    def close(self, timeout_s: float) -> None: ...


INLINE_GET_BYTES = 4 << 20
"""Largest memory hit a GET copies on the event loop: a copy this small costs less than
handing it to an I/O thread and back."""


T = TypeVar("T")


class Daemon:
    """What the routes share: the store, tenants, limits and counters.

    Args:
        built: the store (owned: closed on shutdown) and its spec.
        cfg: the configuration (its ``service`` section).

    Raises:
        ConfigError: limits that contradict each other.
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
        self.limits = Limits(max_value, s.max_body_bytes, s.max_batch_keys, s.max_batch_keys)
        # GET bodies: reused, already faulted-in buffers of one value (see buffers.py).
        self.values = ValueBuffers(max_value + wire.table_bytes(1))
        self.budget = Budget(s.max_inflight_bytes, s.inflight_wait_s)
        self.auth = Authenticator(s.tokens)
        salt = s.key_salt
        if not salt and s.data_dir:
            salt = load_or_create_salt(Path(s.data_dir).expanduser() / "key_salt")
        self.mapper = KeyMapper(salt, tagged=cfg.tenants.enabled)
        self.metrics = RequestMetrics()
        self.tenants = TenantCounters()
        self.ready = False
        # The same-host channel (shared memory), started and stopped by the app's lifespan.
        self.same_host: SideChannel | None = None
        # Store calls that may block (a shared tier's round trip bounded by its budget, a
        # sync journal commit) run here, never on the event loop: a hung Redis must not
        # stall /healthz or the requests that do not need it.
        self._blocking = ThreadPoolExecutor(8, thread_name_prefix="kvtier-daemon")
        self._lookup_blocks = any(isinstance(t, SharedTier) for t in self.store.tiers)
        if self.mapper.random_salt and self.store.stats().chunks:
            log.warning(
                "service.key_salt is empty: the %d chunks recovered at start-up are unreachable",
                self.store.stats().chunks,
            )

    def keys(self, tenant: Tenant, hex_keys: list[str]) -> list[ChunkKey]:
        """The store keys of a tenant's batch of (validated) hex keys."""
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

    def key(self, tenant: Tenant, hex_key: str) -> ChunkKey:
        """The store key of one of a tenant's keys."""
        if not _KEY_RE.match(hex_key):  # routes validate too; this guards direct callers
            raise ApiError(400, "bad_key", f"key {hex_key[:40]!r} is not 32 hex digits")
        (out,) = self.mapper.map(tenant, (ChunkKey(bytes.fromhex(hex_key)),))
        return ChunkKey(out)

    async def _off_loop(self, fn: Callable[..., T], *args: object) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._blocking, fn, *args)

    async def lookup(self, keys: Sequence[ChunkKey]) -> LookupResult:
        """The store's lookup; off the event loop when a shared tier may be asked."""
        if self._lookup_blocks:
            return await self._off_loop(self.store.lookup, keys)
        return self.store.lookup(keys)

    async def delete(self, keys: Sequence[ChunkKey]) -> int:
        """The store's delete, off the event loop (shared tiers, sync journal commits)."""
        return await self._off_loop(self.store.delete, keys)

    def close(self) -> None:
        """Close the store (flushing it) and the daemon's threads. Blocking."""
        self._blocking.shutdown(wait=True)
        self.store.close()
