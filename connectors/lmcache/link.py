"""The LMCache plug points' link to a kvtier daemon: a client that never raises.

:class:`DaemonLink` wraps :class:`kvtier.service.client.Client`. Every call answers: a
daemon that is down, slow, restarting or refusing a request is a miss (lookups and
loads) or a dropped store, logged with the reason; after a failure the link holds off,
answering misses at once (LMCache keeps serving from its other tiers), then tries again,
so it reconnects by itself when the daemon is back (:mod:`kvtier.service.breaker`).

Thread-safe: the client keeps a pool of connections; the breaker keeps its fields under a lock.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from kvtier.errors import ConfigError, KVTierError
from kvtier.keys import ChunkKey
from kvtier.service.breaker import Breaker
from kvtier.service.client import Client
from kvtier.service.protocol import RetryPolicy
from kvtier.store.types import PutResult

log = logging.getLogger(__name__)

# At most one warning per this many seconds about stores the daemon did not keep.
LOG_EVERY_S = 30.0


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
        self._breaker = Breaker(settings.url, dropped="stores", refused="the value")
        # Chunks the daemon answered for but did not keep (full store, tier errors).
        self._lock = threading.Lock()
        self.dropped_total = 0
        self._last_drop_log = -LOG_EVERY_S
        # The daemon's largest value (None until it answered once).
        self.max_value_bytes: int | None = None
        # The daemon's tiers' capacity together, in bytes (0 until it answered once).
        self.capacity_bytes = 0
        self._adopt_limits()

    def _adopt_limits(self) -> None:
        """Split batches under the daemon's own limits (a daemon down now is not fatal)."""
        try:
            stats = self._client.stats()
            limits = stats["limits"]
        except (KVTierError, KeyError, TypeError) as exc:
            self._breaker.failed("start-up check", exc)
            return
        try:
            self.capacity_bytes = sum(int(t["capacity_bytes"]) for t in stats["store"]["tiers"])
        except (KeyError, TypeError, ValueError):
            self.capacity_bytes = 0
        self._client.max_body_bytes = int(limits["max_body_bytes"])
        self._client.batch_keys = int(limits["max_batch_keys"])
        self._client.prefix_keys = int(limits.get("max_prefix_keys", 0))
        self.max_value_bytes = int(limits["max_value_bytes"])

    # -- the breaker ------------------------------------------------------------------------

    def available(self) -> bool:
        """False while the link holds off after a failure (calls answer misses at once)."""
        available: bool = self._breaker.available()
        return available

    @property
    def failures_total(self) -> int:
        """Failed daemon requests since the link was made."""
        n: int = self._breaker.failures_total
        return n

    # -- chunk operations (each answers; none raises) -----------------------------------------

    def exists(self, key: ChunkKey) -> bool:
        found: bool = self._breaker.call("exists", lambda: self._client.exists(key), False)
        return found

    def hits(self, keys: Sequence[ChunkKey]) -> int:
        """Length of the leading run of ``keys`` the daemon holds; 0 when it cannot be asked."""
        if not keys:
            return 0
        what = f"lookup of {len(keys)} keys"
        n: int = self._breaker.call(what, lambda: self._client.lookup(list(keys)).hits, 0)
        return n

    def present(self, keys: Sequence[ChunkKey]) -> list[bool] | None:
        """Which of ``keys`` the daemon holds, key by key; None when it cannot be asked.

        The daemon answers a leading run; after each miss the rest is asked again, so a
        pattern of k runs costs k requests (one for the usual all-hit or hit-prefix).
        """
        out: list[bool] = []
        while len(out) < len(keys):
            rest = list(keys[len(out) :])
            what = f"lookup of {len(rest)} keys"
            got: int | None = self._breaker.call(
                what, lambda rest=rest: self._client.lookup(rest).hits, None
            )
            if got is None:
                return None
            out += [True] * got
            if len(out) < len(keys):
                out.append(False)
        return out

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
        if not keys:
            return ()
        what = f"load of {len(keys)} chunks"
        got = self._breaker.call(what, lambda: self._client.get_into(list(keys), dst), None)
        lengths: tuple[int, ...] = got.value_bytes if got is not None else ()
        return lengths

    def get_value(self, key: ChunkKey) -> bytes | None:
        """One value, whole, whatever its length; None for a miss or when the daemon
        cannot be asked."""
        got: bytes | None = self._breaker.call(
            "load of 1 chunk", lambda: self._client.get(key), None
        )
        return got

    def shared_region(self, nbytes: int) -> npt.NDArray[np.uint8] | None:
        """Memory shared with the daemon (at most ``nbytes``); None while the daemon is
        not reachable through its same-host channel. Never raises."""
        if not self.available():
            return None
        try:
            region: npt.NDArray[np.uint8] | None = self._client.shared_region(nbytes)
        except (KVTierError, OSError) as exc:
            log.debug("kvtier daemon %s: no shared region: %s", self.settings.url, exc)
            return None
        return region

    def is_shared(self, array: npt.NDArray[np.uint8]) -> bool:
        """True while ``array`` is memory the daemon's current same-host channel maps;
        False while the link holds off after a failure. Never raises."""
        if not self.available():
            return False
        try:
            shared: bool = self._client.is_shared(array)
        except (KVTierError, OSError):
            return False
        return shared

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
        limit = self.max_value_bytes
        too_big = 0
        if limit is not None and any(v.nbytes > limit for v in values):
            # The daemon refuses a batch holding a value over its limit as a whole:
            # leave those out, so the rest is kept (they count as rejected).
            fits = [(k, v) for k, v in zip(keys, values, strict=True) if v.nbytes <= limit]
            too_big = len(keys) - len(fits)
            keys, values = [k for k, _ in fits], [v for _, v in fits]
        res: PutResult | None = PutResult(0, 0, 0, 0)
        if keys:
            what = f"store of {len(keys)} chunks"
            res = self._breaker.call(
                what, lambda: self._client.put_many(list(keys), list(values)), None
            )
        if res is not None and too_big:
            res = PutResult(res.stored, res.present, res.rejected + too_big, res.failed)
        if res is not None and (res.rejected or res.failed):
            self._dropped(res, len(keys) + too_big, too_big)
        return res

    def _dropped(self, res: PutResult, asked: int, too_big: int = 0) -> None:
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
                "log); those chunks will miss%s",
                self.settings.url,
                res.stored + res.present,
                asked,
                res.rejected,
                res.failed,
                (
                    f"; {too_big} over its service.max_value_bytes ({self.max_value_bytes} B) "
                    "were not sent: raise it"
                    if too_big
                    else ""
                ),
            )

    def delete(self, key: ChunkKey) -> bool:
        gone: bool = self._breaker.call("delete", lambda: self._client.delete(key), False)
        return gone

    def delete_many(self, keys: Sequence[ChunkKey]) -> list[bool | None]:
        """Remove ``keys``: per key True (it was there), False (it was not), or None
        (the daemon could not be asked)."""
        out: list[bool | None] = []
        for key in keys:
            out.append(self._breaker.call("delete", lambda key=key: self._client.delete(key), None))
        return out

    def ready(self) -> bool:
        """True when the daemon answers /readyz (does not touch the breaker)."""
        ready: bool = self._client.ready()
        return ready

    def close(self) -> None:
        self._client.close()
