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
(lookups and loads) or a dropped save, logged at most once per :data:`LOG_EVERY_S`. No
engine step waits longer than about ``timeout_s`` (one retry): after a failure the
store stops calling the daemon for a hold-off that doubles up to :data:`MAX_HOLD_S`,
answering misses at once, then tries again, so it reconnects when the daemon returns.

Threading: one instance per worker, used from the engine thread (loads) and the save
thread (saves); the client is thread-safe and the breaker's fields sit under a lock.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np
import numpy.typing as npt

from kvtier.errors import ConfigError, InputError, KVTierError
from kvtier.store.types import GetResult, LookupResult, PutResult

from .keys import rank_keys
from .settings import DaemonSettings

if TYPE_CHECKING:
    from kvtier.service.client import Client

log = logging.getLogger(__name__)

T = TypeVar("T")

LOG_EVERY_S = 30.0
FIRST_HOLD_S = 0.5
MAX_HOLD_S = 5.0
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
        )
        self._lock = threading.Lock()
        self._hold_until = 0.0
        self._hold_s = FIRST_HOLD_S
        self._last_log = -LOG_EVERY_S
        self._failures = 0
        self._staging: npt.NDArray[np.uint8] | None = None
        self._check_limits()

    def _check_limits(self) -> None:
        try:
            limits = self._client.stats()["limits"]
        except KVTierError as exc:
            # Not fatal: the daemon may start after the engine. A too-small limit then
            # shows as refused saves, logged with the same advice.
            self._failed("start-up check", exc)
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
        log.info(
            "kvtier daemon mode: %s, chunk %d B (daemon max_value_bytes %d)",
            self.settings.url,
            self.chunk_bytes,
            max_value,
        )

    # -- the breaker --------------------------------------------------------------------------

    def _available(self) -> bool:
        with self._lock:
            return time.monotonic() >= self._hold_until

    def _ok(self) -> None:
        with self._lock:
            if self._failures:
                log.info("kvtier daemon %s answers again", self.settings.url)
            self._failures = 0
            self._hold_s = FIRST_HOLD_S
            self._hold_until = 0.0

    def _failed(self, what: str, exc: Exception) -> None:
        now = time.monotonic()
        with self._lock:
            self._failures += 1
            self._hold_until = now + self._hold_s
            self._hold_s = min(MAX_HOLD_S, self._hold_s * 2)
            speak = now - self._last_log >= LOG_EVERY_S
            if speak:
                self._last_log = now
            failures = self._failures
        if speak:
            hint = (
                f"; the daemon refuses values of {self.chunk_bytes} B: raise its "
                "service.max_value_bytes"
                if isinstance(exc, InputError)
                else ""
            )
            log.warning(
                "kvtier daemon %s: %s failed (%d in a row), serving misses and dropping saves "
                "until it answers: %s%s",
                self.settings.url,
                what,
                failures,
                exc,
                hint,
            )

    # -- the store API the worker uses ----------------------------------------------------------

    def lookup(self, keys: Sequence[bytes]) -> LookupResult:
        """Leading run of ``keys`` the daemon holds; a miss when it cannot be asked."""
        if not keys or not self._available():
            return LookupResult(0, ())
        try:
            res: LookupResult = self._client.lookup([bytes(k).hex() for k in keys])
        except KVTierError as exc:
            self._failed("lookup", exc)
            return LookupResult(0, ())
        self._ok()
        return res

    def get(self, keys: Sequence[bytes], dst: npt.NDArray[Any]) -> Future[GetResult]:
        """Copy the leading run of present chunks into ``dst`` (packed), synchronously."""
        if not keys or not self._available():
            return _done(GetResult(0, 0, (), ()))
        try:
            got = self._client.get_into([bytes(k).hex() for k in keys], dst)
        except KVTierError as exc:
            self._failed(f"load of {len(keys)} chunks", exc)
            return _done(GetResult(0, 0, (), ()))
        self._ok()
        return _done(GetResult(got.chunks, got.nbytes, got.value_bytes, (TIER_NAME,) * got.chunks))

    def put(self, keys: Sequence[bytes], data: npt.NDArray[Any]) -> Future[PutResult]:
        """Store ``len(keys)`` chunks packed in ``data``; a dropped save counts as failed."""
        n = len(keys)
        if not n:
            return _done(PutResult(0, 0, 0, 0))
        if not self._available():
            return _done(PutResult(0, 0, 0, n))
        flat = data.reshape(-1).view(np.uint8)
        size = flat.nbytes // n
        values = [flat[i * size : (i + 1) * size].data for i in range(n)]
        try:
            res = self._client.put_many([bytes(k).hex() for k in keys], values)
        except KVTierError as exc:
            self._failed(f"save of {n} chunks", exc)
            return _done(PutResult(0, 0, 0, n))
        self._ok()
        return _done(res)

    def staging(self, nbytes: int) -> npt.NDArray[np.uint8] | None:
        """A reusable buffer of ``nbytes`` in memory shared with the daemon, or None when
        values go through HTTP. A get into it costs one copy in all (the daemon's, from
        its tier); the buffer is overwritten by the next call. For one thread (loads run
        on the engine thread)."""
        if self._client.same_host_socket is None:
            return None
        if self._staging is None or self._staging.nbytes < nbytes:
            try:
                self._staging = self._client.shared_buffer(max(nbytes, 2 * self.chunk_bytes))
            except KVTierError as exc:
                self._failed("shared staging", exc)
                return None
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
