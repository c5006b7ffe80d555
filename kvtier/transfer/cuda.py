"""CUDA streams and events for the transfer engine; imported only for CUDA devices.

Four side streams, so the two directions never queue behind each other (PCIe is full
duplex) and, within a direction, the kernels of group i+1 run while the copy engine
moves group i:

* ``gather``: store kernels (``index_select`` into staging);
* ``d2h``: staging to host copies;
* ``h2d``: host to staging copies;
* ``scatter``: load kernels (``index_copy_`` out of staging).

Side streams are created at the default (lowest) priority, so the model's kernels on
the compute stream are never deprioritised behind a transfer.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Any

import torch

from kvtier.transfer.sync import STREAMS


class _Restore:
    """Puts back the current streams of the caller's device and of ``device`` (setting a
    stream also makes its device current, as ``torch.cuda.stream`` would on exit)."""

    __slots__ = ("_caller", "_ours")

    def __init__(self, device: torch.device) -> None:
        self._caller = torch.cuda.current_stream()
        self._ours = torch.cuda.current_stream(device)

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        torch.cuda.set_stream(self._ours)
        if self._caller.device != self._ours.device:
            torch.cuda.set_stream(self._caller)


class CudaSync:
    """Stream-ordered execution on one CUDA device."""

    immediate = False

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._streams: dict[str, torch.cuda.Stream] = {}
        for name in STREAMS:
            self._streams[name] = torch.cuda.Stream(device=device)  # type: ignore[no-untyped-call]
        # Events that only carry an order from one stream to another, recorded and waited
        # on at once, are reused: a stream wait takes the event's latest record at the
        # time of the wait, so re-recording it later changes nothing already waited for.
        # A fresh event costs its creation at its first record, several times a reused
        # one's record, and a transfer would make two per unit. Used under the engine's
        # lock only.
        self._links: dict[tuple[str, str], torch.cuda.Event] = {}

    def issuing(self) -> AbstractContextManager[Any]:
        return _Restore(self.device)

    def use(self, name: str) -> None:
        # One C call: a ``torch.cuda.stream(...)`` context per step costs several times
        # as much Python, and a transfer switches streams at every step.
        torch.cuda.set_stream(self._streams[name])

    def record(self, name: str) -> torch.cuda.Event:
        ev = torch.cuda.Event()  # type: ignore[no-untyped-call]
        ev.record(self._streams[name])
        return ev

    def wait(self, name: str, event: Any) -> None:
        if event is not None:
            self._streams[name].wait_event(event)

    def _link(self, first: str, then: str) -> torch.cuda.Event:
        ev = self._links.get((first, then))
        if ev is None:
            ev = self._links[first, then] = torch.cuda.Event()  # type: ignore[no-untyped-call]
        return ev

    def order(self, first: str, then: str) -> None:
        ev = self._link(first, then)
        ev.record(self._streams[first])
        self._streams[then].wait_event(ev)

    def after_current(self, name: str) -> None:
        """Make stream ``name`` wait for everything queued so far on the current stream."""
        ev = self._link("current", name)
        ev.record(torch.cuda.current_stream(self.device))
        self._streams[name].wait_event(ev)

    def query(self, event: Any) -> bool:
        return event is None or bool(event.query())

    def synchronize(self, event: Any) -> None:
        if event is not None:
            event.synchronize()

    def current_waits(self, event: Any) -> None:
        if event is not None:
            torch.cuda.current_stream(self.device).wait_event(event)

    def drain(self) -> None:
        for s in self._streams.values():
            s.synchronize()
