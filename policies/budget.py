"""The SSD write budget: bytes per day that admission may never exceed.

The budget is ``DWPD x capacity x headroom`` bytes per day, enforced over a sliding
window: in any window of ``window_s`` seconds, at most ``bytes_per_day * window_s /
86400`` bytes are granted. A one-day window lets a busy hour spend a quiet night's
allowance (the literal "bytes per day", the default of the placement); a shorter window
paces writes evenly (one hour keeps a peak hour from spending a whole day).

Grants are counted in one-minute buckets; a bucket counts whole while any part of it is
inside the window, so the check is conservative: the true sliding sum is never above
the allowance. Time comes from an injected clock (wall time in a store, trace time in
the simulator).
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable

from kvtier.errors import ConfigError

SECONDS_PER_DAY = 86400.0
BUCKET_S = 60.0


class WriteBudget:
    """A sliding-window byte allowance.

    Args:
        bytes_per_day: the daily budget.
        window_s: enforcement window, seconds (60 .. 86400).
        clock: seconds, monotonic.
    """

    def __init__(
        self,
        bytes_per_day: float,
        *,
        window_s: float = 3600.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if bytes_per_day < 0 or math.isnan(bytes_per_day):
            raise ConfigError("write_budget.bytes_per_day", bytes_per_day, "a number >= 0")
        if not BUCKET_S <= window_s <= SECONDS_PER_DAY:
            raise ConfigError("write_budget.window_s", window_s, "in [60, 86400] seconds")
        self.bytes_per_day = bytes_per_day
        self.window_s = window_s
        self.allowance_bytes = bytes_per_day * window_s / SECONDS_PER_DAY
        self._clock = clock
        # The window spans this many whole buckets, plus the one partly inside it.
        self._span = math.ceil(window_s / BUCKET_S) + 1
        self._buckets: deque[tuple[int, float]] = deque()
        self._in_window = 0.0
        self.granted_bytes = 0.0
        self.refused_bytes = 0.0
        self.forced_bytes = 0.0

    def _expire(self, now_bucket: int) -> None:
        while self._buckets and self._buckets[0][0] <= now_bucket - self._span:
            _, spent = self._buckets.popleft()
            self._in_window -= spent

    def available(self) -> float:
        """Bytes that could be granted now."""
        self._expire(int(self._clock() // BUCKET_S))
        return max(self.allowance_bytes - self._in_window, 0.0)

    def try_spend(self, nbytes: float) -> bool:
        """Grant ``nbytes`` if the window has room; all or nothing."""
        b = int(self._clock() // BUCKET_S)
        self._expire(b)
        if self._in_window + nbytes > self.allowance_bytes:
            self.refused_bytes += nbytes
            return False
        self._record(b, nbytes)
        self.granted_bytes += nbytes
        return True

    def spend(self, nbytes: float) -> None:
        """Count writes that happen whatever the budget says (a put the store must take).

        They use up the window like grants, so later optional writes (demotions) wait;
        they may take the window past its allowance, which ``forced_bytes`` reports.
        """
        b = int(self._clock() // BUCKET_S)
        self._expire(b)
        self._record(b, nbytes)
        self.forced_bytes += nbytes

    def _record(self, bucket: int, nbytes: float) -> None:
        if self._buckets and self._buckets[-1][0] == bucket:
            self._buckets[-1] = (bucket, self._buckets[-1][1] + nbytes)
        else:
            self._buckets.append((bucket, nbytes))
        self._in_window += nbytes
