"""What the daemon bounds: value, body and batch sizes (clients read them in /v1/stats)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Limits:
    """Enforced limits, in bytes and keys."""

    max_value_bytes: int
    max_body_bytes: int
    max_batch_keys: int
