"""Handles the store gives out on slots in place: a reservation to fill, a value to read.

Both point into a tier's memory and are counted as operations in flight, so
:meth:`~kvtier.store.store.TieredStore.drain` and ``close`` wait until each one ends.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from kvtier.keys import ChunkKey
from kvtier.store.mover import Mover
from kvtier.store.slots import Slot
from kvtier.store.types import PutResult

Done = Callable[[object], None]
"""Ends one operation the store counted as in flight (its argument is ignored)."""


@dataclass(eq=False)
class HeldValue:
    """A chunk's value held in place by :meth:`TieredStore.hold_value`.

    Read :attr:`view`, then call :meth:`release` once (later calls are no-ops); never
    use the view after. One owner.
    """

    _mover: Mover = field(repr=False)
    _done: Done = field(repr=False)
    slot: Slot = field(repr=False)
    view: memoryview = field(repr=False)
    _released: bool = field(default=False, repr=False)

    def release(self) -> None:
        """End the hold and count the get (hits, placement, tier reads) as a get does."""
        if self._released:
            return
        self._released = True
        try:
            self._mover.complete_hold(self.slot)
        finally:
            self._done(None)


@dataclass(eq=False)
class Reservation:
    """One slot reserved by :meth:`TieredStore.reserve`, filled in place by its owner.

    Fill all of :attr:`view`, then call :meth:`commit`; or :meth:`abort`. Exactly one of
    the two, once (later calls are no-ops). One owner; the view may be filled from any
    thread. The view points into the tier's memory: never use it after commit or abort.
    """

    _mover: Mover = field(repr=False)
    _done: Done = field(repr=False)
    key: ChunkKey
    tier: int
    _offset: int
    view: memoryview = field(repr=False)
    _open: bool = field(default=True, init=False)

    def commit(self) -> PutResult:
        """Index the chunk (its value is what :attr:`view` holds now). Never blocks on I/O."""
        if not self._open:
            return PutResult(0, 0, 0, 0)
        self._open = False
        try:
            self._mover.complete_reserved(self.tier, self.key, self._offset, self.view.nbytes)
        finally:
            self._done(None)
        return PutResult(1, 0, 0, 0)

    def abort(self) -> None:
        """Give the slot back; the chunk is not stored (its key stays absent)."""
        if not self._open:
            return
        self._open = False
        try:
            self._mover.cancel_reserved(self.tier, self.key, self._offset)
        finally:
            self._done(None)
