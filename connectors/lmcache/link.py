"""The LMCache plug points' link to a kvtier daemon: a client that never raises.

:class:`DaemonLink` wraps :class:`kvtier.service.client.Client`. Every call answers: a
daemon that is down, slow, restarting or refusing a request is a miss (lookups and
loads) or a dropped store, logged at most once per :data:`LOG_EVERY_S` with the reason.
After a failure the link stops calling the daemon for a hold-off that doubles up to
:data:`MAX_HOLD_S`, answering misses at once (LMCache keeps serving from its other
tiers), then tries again, so it reconnects by itself when the daemon is back.

Thread-safe: the client keeps a pool of connections; the breaker's fields sit under a lock.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass

from kvtier.errors import ConfigError, InputError, KVTierError
from kvtier.keys import ChunkKey
from kvtier.service.client import Client
from kvtier.service.protocol import RetryPolicy
from kvtier.store.types import PutResult

log = logging.getLogger(__name__)

LOG_EVERY_S = 30.0
FIRST_HOLD_S = 0.5
MAX_HOLD_S = 5.0


@dataclass(frozen=True, slots=True)
class DaemonSettings:
    """Where the daemon is and how long one request may take.

    Attributes:
        url: the daemon's base URL, ``http://host:port``.
        token: bearer token of the tenant; None for a daemon without tokens.
        timeout_s: read/write timeout of one request, in seconds (connect: half).
    """

    url: str
    token: str | None = None
    timeout_s: float = 5.0

    def __post_init__(self) -> None:
        if not self.url.startswith(("http://", "https://")):
            raise ConfigError("url", self.url, "an http:// or https:// URL of a kvtier daemon")
        if not self.timeout_s > 0:
            raise ConfigError("timeout_s", self.timeout_s, "seconds > 0")


class DaemonLink:
    """Chunk operations on a kvtier daemon that degrade to misses. Thread-safe.

    Args:
        settings: URL, token and timeout.
        pool: connections kept open (size it to the threads that call the link).
    """

    def __init__(self, settings: DaemonSettings, *, pool: int = 16) -> None:
        self.settings = settings
        self._client = Client(
            settings.url,
            settings.token,
            timeout_s=settings.timeout_s,
            connect_timeout_s=settings.timeout_s / 2,
            # One quick retry: LMCache's own timeouts must not wait out a long backoff.
            retry=RetryPolicy(retries=1, backoff_s=0.02, max_backoff_s=0.05),
            pool=pool,
        )
        self._lock = threading.Lock()
        self._hold_until = 0.0
        self._hold_s = FIRST_HOLD_S
        self._last_log = -LOG_EVERY_S
        self._failures = 0
        self.failures_total = 0
        # Chunks the daemon answered for but did not keep (full store, tier errors).
        self.dropped_total = 0
        self._last_drop_log = -LOG_EVERY_S
        # The daemon's largest value (None until it answered once).
        self.max_value_bytes: int | None = None
        self._adopt_limits()

    def _adopt_limits(self) -> None:
        """Split batches under the daemon's own limits (a daemon down now is not fatal)."""
        try:
            limits = self._client.stats()["limits"]
        except (KVTierError, KeyError, TypeError) as exc:
            self._failed("start-up check", exc)
            return
        self._client.max_body_bytes = int(limits["max_body_bytes"])
        self._client.batch_keys = int(limits["max_batch_keys"])
        self.max_value_bytes = int(limits["max_value_bytes"])

    # -- the breaker ------------------------------------------------------------------------

    def available(self) -> bool:
        """False while the link holds off after a failure (calls answer misses at once)."""
        with self._lock:
            return time.monotonic() >= self._hold_until

    def _ok(self) -> None:
        with self._lock:
            if not self._failures:
                return
            self._failures = 0
            self._hold_s = FIRST_HOLD_S
            self._hold_until = 0.0
        log.info("kvtier daemon %s answers again", self.settings.url)

    def _failed(self, what: str, exc: Exception) -> None:
        now = time.monotonic()
        with self._lock:
            self._failures += 1
            self.failures_total += 1
            self._hold_until = now + self._hold_s
            self._hold_s = min(MAX_HOLD_S, self._hold_s * 2)
            speak = now - self._last_log >= LOG_EVERY_S
            if speak:
                self._last_log = now
            failures = self._failures
        if speak:
            hint = (
                "; the daemon refuses the value: raise its service.max_value_bytes"
                if isinstance(exc, InputError)
                else ""
            )
            log.warning(
                "kvtier daemon %s: %s failed (%d in a row); serving misses and dropping "
                "stores until it answers: %s%s",
                self.settings.url,
                what,
                failures,
                exc,
                hint,
            )

    # -- chunk operations (each answers; none raises) -----------------------------------------

    def exists(self, key: ChunkKey) -> bool:
        if not self.available():
            return False
        try:
            found: bool = self._client.exists(key)
        except KVTierError as exc:
            self._failed("exists", exc)
            return False
        self._ok()
        return found

    def hits(self, keys: Sequence[ChunkKey]) -> int:
        """Length of the leading run of ``keys`` the daemon holds; 0 when it cannot be asked."""
        if not keys or not self.available():
            return 0
        try:
            n: int = self._client.lookup(list(keys)).hits
        except KVTierError as exc:
            self._failed(f"lookup of {len(keys)} keys", exc)
            return 0
        self._ok()
        return n

    def get_into(self, key: ChunkKey, dst: memoryview) -> int:
        """Copy one value into ``dst``; its length in bytes, or 0 for a miss."""
        got = self.get_into_many([key], dst)
        return got[0] if got else 0

    def get_into_many(self, keys: Sequence[ChunkKey], dst: memoryview) -> tuple[int, ...]:
        """Copy the leading present values of ``keys`` into ``dst``, packed.

        Returns:
            the length in bytes of each value copied, in key order (empty: a miss, or
            the daemon could not be asked).
        """
        if not keys or not self.available():
            return ()
        try:
            got = self._client.get_into(list(keys), dst)
        except KVTierError as exc:
            self._failed(f"load of {len(keys)} chunks", exc)
            return ()
        self._ok()
        lengths: tuple[int, ...] = got.value_bytes
        return lengths

    def put(self, key: ChunkKey, value: memoryview) -> bool:
        """Store one value; True when the daemon holds it afterwards."""
        res = self.put_many([key], [value])
        return res is not None and res.stored + res.present == 1

    def put_many(self, keys: Sequence[ChunkKey], values: Sequence[memoryview]) -> PutResult | None:
        """Store values in as few requests as the daemon's limits allow.

        Returns:
            the daemon's counts (a full store shows as ``rejected``), or None when the
            daemon could not be asked (the values are dropped).
        """
        if not keys:
            return PutResult(0, 0, 0, 0)
        if not self.available():
            return None
        try:
            res: PutResult = self._client.put_many(list(keys), list(values))
        except KVTierError as exc:
            self._failed(f"store of {len(keys)} chunks", exc)
            return None
        self._ok()
        if res.rejected or res.failed:
            self._dropped(res, len(keys))
        return res

    def _dropped(self, res: PutResult, asked: int) -> None:
        """Say, at most once per LOG_EVERY_S, that the daemon kept fewer chunks than sent.

        Not a link failure (the daemon answered): the breaker stays closed, lookups of
        the dropped chunks are misses, and LMCache keeps its other copies.
        """
        now = time.monotonic()
        with self._lock:
            self.dropped_total += res.rejected + res.failed
            speak = now - self._last_drop_log >= LOG_EVERY_S
            if speak:
                self._last_drop_log = now
        if speak:
            log.warning(
                "kvtier daemon %s kept %d of %d chunks: %d rejected (its store is full or "
                "its placement declined them), %d failed (a tier error: see the daemon's "
                "log); those chunks will miss",
                self.settings.url,
                res.stored + res.present,
                asked,
                res.rejected,
                res.failed,
            )

    def delete(self, key: ChunkKey) -> bool:
        if not self.available():
            return False
        try:
            gone: bool = self._client.delete(key)
        except KVTierError as exc:
            self._failed("delete", exc)
            return False
        self._ok()
        return gone

    def ready(self) -> bool:
        """True when the daemon answers /readyz (does not touch the breaker)."""
        ready: bool = self._client.ready()
        return ready

    def close(self) -> None:
        self._client.close()
