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


class CudaSync:
    """Stream-ordered execution on one CUDA device."""

    immediate = False

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._streams: dict[str, torch.cuda.Stream] = {}
        for name in STREAMS:
            self._streams[name] = torch.cuda.Stream(device=device)  # type: ignore[no-untyped-call]

    def on(self, name: str) -> AbstractContextManager[Any]:
        return torch.cuda.stream(self._streams[name])

    def record(self, name: str) -> torch.cuda.Event:
        ev = torch.cuda.Event()  # type: ignore[no-untyped-call]
        ev.record(self._streams[name])
        return ev

    def wait(self, name: str, event: Any) -> None:
        if event is not None:
            self._streams[name].wait_event(event)

    def after_current(self, name: str) -> None:
        """Make stream ``name`` wait for everything queued so far on the current stream."""
        ev = torch.cuda.Event()  # type: ignore[no-untyped-call]
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
