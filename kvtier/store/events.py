"""The store's listeners, and the one way its parts tell them what happened.

The index announces what it indexed and unindexed (under its lock, so the events follow
the index's order); the mover announces what it stored, moved and failed. Both are
handed one :class:`Events` by the store, so neither reaches into the other for it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from kvtier.store.types import StoreEvent

log = logging.getLogger(__name__)

Listener = Callable[[StoreEvent], None]


class Events:
    """Listeners of one store. ``add`` before the store is shared between threads;
    ``emit`` from any thread (the store's I/O threads, and callers' own)."""

    __slots__ = ("_listeners",)

    def __init__(self) -> None:
        self._listeners: list[Listener] = []

    def add(self, listener: Listener) -> None:
        """Call ``listener`` with every event from now on."""
        self._listeners.append(listener)

    def emit(self, event: StoreEvent) -> None:
        """Hand ``event`` to every listener; a listener that raises is logged and skipped."""
        for listener in self._listeners:
            try:
                listener(event)
            except Exception:  # a listener's bug must not break a store operation
                log.exception("store listener failed on %s", event.kind.value)
