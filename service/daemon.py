"""The daemon's state, apart from its routes: the store, tenants, limits and counters.

:class:`Daemon` holds what every front end shares; the request core
(:mod:`kvtier.service.core`) runs the logic of one request over it. Here too: the store
calls of many keys (lookup, delete, batch get) that both the HTTP routes and the core use.
"""

from __future__ import annotations

import asyncio
import logging
import re
from collections.abc import Callable, MutableMapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Protocol, TypeVar

from kvtier.config import KVTierConfig
from kvtier.errors import ConfigError, InputError
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
"""Largest memory hit a GET copies on the event loop (a 4 MiB memcpy is ~0.5 ms)."""


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
        self.mapper = KeyMapper(salt)
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

    async def batch_get(
        self, t: Tenant, hex_keys: list[str], scope: MutableMapping[str, Any]
    ) -> memoryview:
        """The batch body (KVTB, :mod:`.wire`) of the leading present keys of tenant ``t``
        (the shared logic of both ``POST /v1/batch/get`` paths).

        The body is capped at ``max_body_bytes`` (its TRUNCATED flag says more may
        follow); its buffer is sized to the hits and held from the in-flight budget for
        the rest of the request (``scope``).

        Raises:
            ApiError: 413 too many keys, 400 a malformed key, 503 the budget is spent.
        """
        ikeys = self.keys(t, hex_keys)
        hit = await self.lookup(ikeys)
        n, room = 0, self.limits.max_body_bytes - wire.table_bytes(hit.hits)
        for size in hit.value_bytes:
            if n and size > room:
                break
            room -= size
            n += 1
        start = wire.table_bytes(n)
        payload = sum(hit.value_bytes[:n])
        self.budget.hold(scope, start + payload)
        view = self.values.take(start + payload).data
        chunks, nbytes, lengths = 0, 0, tuple[int, ...]()
        if n:
            try:
                # A hit in memory is copied on the event loop, as a single GET's is.
                fut = self.store.get(ikeys[:n], view[start:], inline_memory_bytes=INLINE_GET_BYTES)
                res = fut.result() if fut.done() else await asyncio.wrap_future(fut)
                chunks, nbytes, lengths = res.chunks, res.nbytes, res.value_bytes
            except InputError:
                # A key evicted and stored again with another length since the lookup:
                # the run no longer fits its buffer. Answer the misses that it now is.
                pass
        # Keys evicted between lookup and get shorten the run; the table then has gaps
        # before the payload, which payload_offset allows.
        flags = wire.FLAG_TRUNCATED if chunks == n < hit.hits else 0
        wire.write_header(view, chunks, start, flags)
        wire.write_table(view, [ChunkKey(bytes.fromhex(k)) for k in hex_keys[:chunks]], lengths)
        self.tenants.add(
            t.name,
            get_chunks=chunks,
            get_bytes=nbytes,
            lookup_hit_chunks=chunks,
            lookup_miss_chunks=len(hex_keys) - chunks,
        )
        return view[: start + nbytes]
