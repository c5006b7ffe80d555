"""What the daemon bounds: value, body and batch sizes (clients read them in /v1/stats),
and the bytes of all bodies in flight together (:class:`Budget`)."""

from __future__ import annotations

import asyncio
from collections import deque
from dataclasses import dataclass

from starlette.types import Scope

from .errors import RETRY_AFTER_S, ApiError

TENANT = "kvtier.tenant"
"""Scope key of the tenant the gate (:mod:`kvtier.service.guards`) authenticated."""
HELD = "kvtier.held_bytes"
"""Scope key of the budget bytes a request holds until it ends."""


@dataclass(frozen=True, slots=True)
class Limits:
    """Enforced limits, in bytes and keys."""

    max_value_bytes: int
    max_body_bytes: int
    max_batch_keys: int
    # Prefix keys one batch put may name (its PREFIX flag, kvtier.service.wire);
    # 0 from a daemon that takes none, so a client sends none.
    max_prefix_keys: int = 0


class Budget:
    """Bytes of bodies in flight, against one bound. Event-loop only (no lock needed).

    A request that does not fit waits, in arrival order, up to ``wait_s`` for others to
    give their bytes back (:meth:`acquire`): a burst of large puts then queues for a few
    milliseconds instead of failing, while a waiting request has read no body yet, so
    the bound on memory holds. Past ``wait_s``: refused (the caller answers 503).

    Args:
        limit_bytes: the bound (``service.max_inflight_bytes``).
        wait_s: the longest wait for room (``service.inflight_wait_s``); 0: refuse at once.
    """

    def __init__(self, limit_bytes: int, wait_s: float = 0.0) -> None:
        self.limit_bytes = limit_bytes
        self.wait_s = wait_s
        self.used_bytes = 0
        self.refused = 0
        self.waited = 0
        self._queue: deque[tuple[int, asyncio.Future[None]]] = deque()

    def take(self, n: int) -> bool:
        """Take ``n`` bytes now, or refuse (no wait)."""
        if self.used_bytes + n > self.limit_bytes:
            self.refused += 1
            return False
        self.used_bytes += n
        return True

    def take_now(self, n: int) -> bool:
        """Take ``n`` bytes if :meth:`acquire` would grant them without a wait; else
        nothing (not counted as refused: the caller then goes through :meth:`acquire`)."""
        if self._queue or self.used_bytes + n > self.limit_bytes:
            return False
        self.used_bytes += n
        return True

    async def acquire(self, n: int) -> bool:
        """Take ``n`` bytes, waiting up to ``wait_s`` behind earlier waiters for room."""
        if not self._queue and self.used_bytes + n <= self.limit_bytes:
            self.used_bytes += n
            return True
        if self.wait_s <= 0 or n > self.limit_bytes:
            self.refused += 1
            return False
        self.waited += 1
        entry = (n, asyncio.get_running_loop().create_future())
        self._queue.append(entry)
        try:
            await asyncio.wait_for(asyncio.shield(entry[1]), self.wait_s)
        except TimeoutError:
            if entry[1].done():  # granted as the wait ran out: the bytes are held
                return True
            self._queue.remove(entry)
            self.refused += 1
            self._grant()  # a large waiter at the head may have held back smaller ones
            return False
        except asyncio.CancelledError:
            if entry[1].done():
                self.give(n)
            else:
                self._queue.remove(entry)
                self._grant()
            raise
        return True

    def give(self, n: int) -> None:
        self.used_bytes -= n
        self._grant()

    def _grant(self) -> None:
        while self._queue and self.used_bytes + self._queue[0][0] <= self.limit_bytes:
            n, fut = self._queue.popleft()
            self.used_bytes += n
            fut.set_result(None)

    def hold(self, scope: Scope, n: int) -> None:
        """Take ``n`` bytes for the rest of this request (the gate gives them back).

        Raises:
            ApiError: 503, the budget is spent.
        """
        if not self.take(n):
            raise busy(self)
        scope[HELD] = scope.get(HELD, 0) + n


def busy(b: Budget) -> ApiError:
    return ApiError(
        503,
        "busy",
        f"bodies in flight are at the daemon's bound of {b.limit_bytes} B "
        "(service.max_inflight_bytes); retry",
        {"Retry-After": str(RETRY_AFTER_S)},
    )
