"""The breaker between an engine-side link and a kvtier daemon: failures become misses.

The vLLM connector's daemon mode (:mod:`kvtier.connectors.vllm.remote`) and the LMCache
link (:mod:`kvtier.connectors.lmcache.link`) call the daemon from an engine's threads,
where a daemon that is down, slow or refusing must never raise or stall a step. Through
:meth:`Breaker.call` a failed request answers the caller's miss, is logged at most once per
:data:`LOG_EVERY_S`, and opens a hold-off (doubling from :data:`FIRST_HOLD_S` up to
:data:`MAX_HOLD_S`) during which calls answer the miss at once without asking the daemon;
the first success after it closes the breaker again, so the link reconnects by itself.
A request the daemon refuses (:class:`~kvtier.errors.InputError`: 400/413/422, a value
over its size limit) is not an outage: it answers the miss and is logged, but opens no
hold-off, so the next request (a lookup of chunks stored before) is asked as usual.

Thread-safe: the fields sit under one lock; the logging happens outside it.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import TypeVar

from kvtier.errors import InputError, KVTierError

log = logging.getLogger(__name__)

T = TypeVar("T")

LOG_EVERY_S = 30.0
FIRST_HOLD_S = 0.5
MAX_HOLD_S = 5.0


class Breaker:
    """Hold-off after failures of one daemon, and the one warning that says why.

    Args:
        url: the daemon's URL (named in the log lines).
        dropped: what a failure drops besides answering misses, e.g. ``"saves"``.
        refused: what the daemon refuses when it answers a too-large value, e.g.
            ``"values of 4096 B"`` (the warning then advises raising its limit).
    """

    def __init__(self, url: str, *, dropped: str, refused: str) -> None:
        self.url = url
        self._dropped = dropped
        self._refused = refused
        self._lock = threading.Lock()
        self._hold_until = 0.0
        self._hold_s = FIRST_HOLD_S
        self._last_log = -LOG_EVERY_S
        self._failures = 0
        self.failures_total = 0
        self.refused_total = 0  # requests the daemon refused (no hold-off)
        self._last_refusal_log = -LOG_EVERY_S

    def available(self) -> bool:
        """False while the breaker holds off after a failure."""
        with self._lock:
            return time.monotonic() >= self._hold_until

    def ok(self) -> None:
        """A request succeeded: close the breaker."""
        with self._lock:
            if not self._failures:
                return
            self._failures = 0
            self._hold_s = FIRST_HOLD_S
            self._hold_until = 0.0
        log.info("kvtier daemon %s answers again", self.url)

    def failed(self, what: str, exc: Exception) -> None:
        """A request (``what``, for the log) failed with ``exc``: hold off, doubling."""
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
                f"; the daemon refuses {self._refused}: raise its service.max_value_bytes"
                if isinstance(exc, InputError)
                else ""
            )
            log.warning(
                "kvtier daemon %s: %s failed (%d in a row), serving misses and dropping %s "
                "until it answers: %s%s",
                self.url,
                what,
                failures,
                self._dropped,
                exc,
                hint,
            )

    def refused(self, what: str, exc: InputError) -> None:
        """The daemon refused a request (``what``): counted and logged, no hold-off."""
        now = time.monotonic()
        with self._lock:
            self.refused_total += 1
            speak = now - self._last_refusal_log >= LOG_EVERY_S
            if speak:
                self._last_refusal_log = now
        if speak:
            log.warning(
                "kvtier daemon %s refused a %s (its other requests go on): %s; if it "
                "refuses %s, raise its service.max_value_bytes",
                self.url,
                what,
                exc,
                self._refused,
            )

    def call(self, what: str, request: Callable[[], T], miss: T) -> T:
        """``request()``'s answer, or ``miss`` while holding off or when it raises.

        Only :class:`~kvtier.errors.KVTierError` (what the client raises) is caught: any
        other exception is a bug and propagates. A refusal (``InputError``) answers
        ``miss`` without holding off.
        """
        if not self.available():
            return miss
        try:
            answer = request()
        except InputError as exc:
            self.refused(what, exc)
            return miss
        except KVTierError as exc:
            self.failed(what, exc)
            return miss
        self.ok()
        return answer
