"""What the daemon bounds: value, body and batch sizes (clients read them in /v1/stats),
and the bytes of all bodies in flight together (:class:`Budget`)."""

from __future__ import annotations

from dataclasses import dataclass

from starlette.types import Scope

from .errors import RETRY_AFTER_S, ApiError

TENANT = "kvtier.tenant"
"""Scope key of the tenant the gate (:mod:`kvtier.service.guards`) authenticated."""
HELD = "kvtier.held_bytes"
"""Scope key of the budget bytes a request holds until it ends."""
BODY_BYTES = "kvtier.body_bytes"
"""Scope key of body bytes a route received without ``receive()`` (metrics count them)."""


@dataclass(frozen=True, slots=True)
class Limits:
    """Enforced limits, in bytes and keys."""

    max_value_bytes: int
    max_body_bytes: int
    max_batch_keys: int


class Budget:
    """Bytes of bodies in flight, against one bound. Event-loop only (no lock needed).

    Args:
        limit_bytes: the bound (``service.max_inflight_bytes``).
    """

    def __init__(self, limit_bytes: int) -> None:
        self.limit_bytes = limit_bytes
        self.used_bytes = 0
        self.refused = 0

    def take(self, n: int) -> bool:
        if self.used_bytes + n > self.limit_bytes:
            self.refused += 1
            return False
        self.used_bytes += n
        return True

    def give(self, n: int) -> None:
        self.used_bytes -= n

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
