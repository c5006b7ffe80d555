"""Daemon mode: the connector's store is a running ``kvtier serve``, shared by engines.

With ``url`` (and ``token``) in ``kv_connector_extra_config`` each worker talks to the
daemon through :class:`kvtier.service.client.Client` instead of building an embedded
:class:`~kvtier.store.TieredStore`. :class:`RemoteStore` gives the worker the part of
the store's API it uses (``put``/``get`` returning futures, ``lookup``, ``stats``,
``tiers``, ``close``), so the worker's code paths are the same in both modes.

Keys: the worker's rank keys (16 bytes) go out as hex; the daemon maps them into the
token's tenant namespace, so engines with the same token share chunks and engines with
different tokens never see each other's.

Faults (STYLE.md rule 5): the daemon being down, slow or refusing a request is a miss
(lookups and loads) or a dropped save, logged with the reason. No engine step waits
longer than about ``timeout_s`` (one retry): after a failure the store holds off,
answering misses at once, then tries again, so it reconnects when the daemon returns
(:mod:`kvtier.service.breaker`).

Threading: one instance per worker, used from the engine thread (loads) and the save
thread (saves); the client is thread-safe and the breaker keeps its fields under a lock.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np
import numpy.typing as npt

from kvtier.errors import ConfigError, KVTierError
from kvtier.service.breaker import Breaker
from kvtier.store.types import GetResult, LookupResult, PutResult

from .keys import rank_keys
from .settings import DaemonSettings

if TYPE_CHECKING:
    from kvtier.service.client import Client

log = logging.getLogger(__name__)

T = TypeVar("T")

TIER_NAME = "daemon"


@dataclass(frozen=True, slots=True)
class RemoteStats:
    """What ``stats()`` reports in daemon mode: no local tiers (the daemon has its own)."""

    tiers: tuple[Any, ...] = ()


def _done(value: T) -> Future[T]:
    fut: Future[T] = Future()
    fut.set_result(value)
    return fut


class RemoteStore:
    """The worker's store over a kvtier daemon. Every call answers; none raises.

    Args:
        settings: the daemon's URL, token and timeout.
        chunk_bytes: bytes of one chunk of this rank (every put and get uses it).

    Raises:
        ConfigError: the daemon answered and its ``max_value_bytes`` is below
            ``chunk_bytes`` (every save would be refused).
    """

    def __init__(self, settings: DaemonSettings, chunk_bytes: int) -> None:
        # Imported here: the embedded mode does not need httpx.
        from kvtier.service.client import Client
        from kvtier.service.protocol import RetryPolicy

        self.settings = settings
        self.chunk_bytes = chunk_bytes
        self.tiers: tuple[Any, ...] = ()
        self._client: Client = Client(
            settings.url,
            settings.token,
            timeout_s=settings.timeout_s,
            connect_timeout_s=settings.timeout_s / 2,
            # One quick retry: a step must not wait out a long backoff.
            retry=RetryPolicy(retries=1, backoff_s=0.02, max_backoff_s=0.05),
            pool=4,
            ca_file=settings.ca_file,
        )
        self._breaker = Breaker(settings.url, dropped="saves", refused=f"values of {chunk_bytes} B")
        self._staging: npt.NDArray[np.uint8] | None = None
        self._save_staging: npt.NDArray[np.uint8] | None = None
        self._check_limits()

    def _check_limits(self) -> None:
        try:
            limits = self._client.stats()["limits"]
        except KVTierError as exc:
            # Not fatal: the daemon may start after the engine. A too-small limit then
            # shows as refused saves, logged with the same advice.
            self._breaker.failed("start-up check", exc)
            return
        max_value = int(limits["max_value_bytes"])
        if max_value < self.chunk_bytes:
            raise ConfigError(
                "service.max_value_bytes",
                max_value,
                f">= the connector's chunk of {self.chunk_bytes} B (daemon {self.settings.url}); "
                "raise it on the daemon or lower store.chunk_tokens",
            )
        # Batches split under the daemon's own limits, not the client's defaults.
        self._client.max_body_bytes = int(limits["max_body_bytes"])
        self._client.batch_keys = int(limits["max_batch_keys"])
        self._client.prefix_keys = int(limits.get("max_prefix_keys", 0))
        log.info(
            "kvtier daemon mode: %s, chunk %d B (daemon max_value_bytes %d)",
            self.settings.url,
            self.chunk_bytes,
            max_value,
        )

    # -- the store API the worker uses ----------------------------------------------------------

    def lookup(self, keys: Sequence[bytes]) -> LookupResult:
        """Leading run of ``keys`` the daemon holds; a miss when it cannot be asked."""
        if not keys:
            return LookupResult(0, ())
        hexes = [bytes(k).hex() for k in keys]
        res: LookupResult = self._breaker.call(
            "lookup", lambda: self._client.lookup(hexes), LookupResult(0, ())
        )
        return res

    def get(self, keys: Sequence[bytes], dst: npt.NDArray[Any]) -> Future[GetResult]:
        """Copy the leading run of present chunks into ``dst`` (packed), synchronously."""
        got = None
        if keys:
            hexes = [bytes(k).hex() for k in keys]
            what = f"load of {len(keys)} chunks"
            got = self._breaker.call(what, lambda: self._client.get_into(hexes, dst), None)
        if got is None:
            return _done(GetResult(0, 0, (), ()))
        return _done(GetResult(got.chunks, got.nbytes, got.value_bytes, (TIER_NAME,) * got.chunks))

    def put(
        self, keys: Sequence[bytes], data: npt.NDArray[Any], prefix: Sequence[bytes] = ()
    ) -> Future[PutResult]:
        """Store ``len(keys)`` chunks packed in ``data``; a dropped save counts as failed.

        ``prefix``: the sequence's earlier chunks, which the daemon protects while it
        makes room (over HTTP too, unless the daemon predates it).
        """
        n = len(keys)
        if not n:
            return _done(PutResult(0, 0, 0, 0))

        def save() -> PutResult:
            flat = data.reshape(-1).view(np.uint8)
            size = flat.nbytes // n
            values = [flat[i * size : (i + 1) * size].data for i in range(n)]
            saved: PutResult = self._client.put_many(
                [bytes(k).hex() for k in keys], values, prefix=[bytes(k).hex() for k in prefix]
            )
            return saved

        res: PutResult = self._breaker.call(f"save of {n} chunks", save, PutResult(0, 0, 0, n))
        return _done(res)

    def save_staging(self, nbytes: int) -> npt.NDArray[np.uint8] | None:
        """As :meth:`staging`, a second buffer for saves: the worker gathers a save's
        blocks into it and :meth:`put` then sends only offsets (the daemon copies once,
        into its tier). For one thread (the worker's single save thread)."""
        if self._client.same_host_socket is None:
            return None
        if self._save_staging is None or self._save_staging.nbytes < nbytes:
            self._save_staging = self._client.shared_buffer(max(nbytes, 2 * self.chunk_bytes))
        return self._save_staging[:nbytes]

    def staging(self, nbytes: int) -> npt.NDArray[np.uint8] | None:
        """A reusable buffer of ``nbytes`` in memory shared with the daemon, or None when
        values go through HTTP. A get into it costs one copy in all (the daemon's, from
        its tier); the buffer is overwritten by the next call. For one thread (loads run
        on the engine thread)."""
        if self._client.same_host_socket is None:
            return None
        if self._staging is None or self._staging.nbytes < nbytes:
            # Plain memory when shared memory cannot be had (logged by the client).
            self._staging = self._client.shared_buffer(max(nbytes, 2 * self.chunk_bytes))
        return self._staging[:nbytes]

    def stats(self) -> RemoteStats:
        return RemoteStats()

    def close(self) -> None:
        self._client.close()


class DaemonLookup:
    """The scheduler side's question to the daemon: are chunks beyond my mirror stored?

    Another engine's chunks are in the daemon, not in this engine's mirror. The
    scheduler asks with the rank keys of every worker (their salts arrive in the
    workers' metadata); one batch lookup per rank, each bounded by the timeout. A
    failure is a miss (the same breaker as :class:`RemoteStore`). Side-effect free on
    the daemon: a lookup changes no counters but the tenant's own.

    Args:
        store: a :class:`RemoteStore` (its client and breaker).
        world_size: ranks whose salts must be known before the daemon is asked.
    """

    def __init__(self, store: RemoteStore, world_size: int) -> None:
        self.store = store
        self.world_size = world_size
        self.salts: set[bytes] = set()

    def ready(self) -> bool:
        return len(self.salts) >= self.world_size

    def hits(self, logical: Sequence[bytes]) -> int:
        """Leading chunks of ``logical`` that every rank holds in the daemon."""
        n = len(logical)
        for salt in sorted(self.salts):
            if n == 0:
                break
            n = min(n, self.store.lookup(rank_keys(salt, logical[:n])).hits)
        return n
