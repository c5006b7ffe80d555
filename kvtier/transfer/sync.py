"""Execution ordering for the transfer engine, behind one small protocol.

The engine's pipeline is written once against :class:`Sync`. On CUDA
(:class:`kvtier.transfer.cuda.CudaSync`) names map to side streams and ordering is by
events; on CPU (:class:`CpuSync`) every operation runs when it is issued, so events are
``None`` and waits are no-ops. CI (no GPU) therefore runs the same planning, staging
and slot rotation the GPU runs.
"""

from __future__ import annotations

import contextlib
from contextlib import AbstractContextManager
from typing import Any, Protocol

STREAMS = ("gather", "d2h", "h2d", "scatter")


class Sync(Protocol):
    """Where and in which order the engine's operations run."""

    # True when every operation has finished by the time it returns (CPU).
    immediate: bool

    def issuing(self) -> AbstractContextManager[Any]:
        """Context of one transfer's enqueue: on exit, the caller's current stream (and
        device) are as they were on entry, whatever :meth:`use` did in between."""
        ...

    def use(self, name: str) -> None:
        """Issue later operations to stream ``name``; only inside :meth:`issuing`."""
        ...

    def record(self, name: str) -> Any:
        """An event that completes when work issued so far on ``name`` has finished."""
        ...

    def wait(self, name: str, event: Any) -> None:
        """Order later work on ``name`` after ``event`` (None: nothing to wait for)."""
        ...

    def order(self, first: str, then: str) -> None:
        """Order later work on ``then`` after the work issued so far on ``first``."""
        ...

    def after_current(self, name: str) -> None:
        """Order later work on ``name`` after the caller's current stream."""
        ...

    def query(self, event: Any) -> bool:
        """Whether ``event`` has completed; never blocks."""
        ...

    def synchronize(self, event: Any) -> None:
        """Block the host until ``event`` has completed."""
        ...

    def current_waits(self, event: Any) -> None:
        """Order later work on the caller's current stream after ``event``."""
        ...

    def drain(self) -> None:
        """Block until every stream is idle."""
        ...


class CpuSync:
    """Immediate execution: torch CPU ops are synchronous."""

    immediate = True

    def issuing(self) -> AbstractContextManager[Any]:
        return contextlib.nullcontext()

    def use(self, name: str) -> None:
        return None

    def record(self, name: str) -> Any:
        return None

    def wait(self, name: str, event: Any) -> None:
        return None

    def order(self, first: str, then: str) -> None:
        return None

    def after_current(self, name: str) -> None:
        return None

    def query(self, event: Any) -> bool:
        return True

    def synchronize(self, event: Any) -> None:
        return None

    def current_waits(self, event: Any) -> None:
        return None

    def drain(self) -> None:
        return None
