"""Value buffers the daemon reuses instead of allocating one per request.

A GET copies its hit into a buffer that becomes the response body. Allocated fresh, a
buffer of a whole chunk (32 MiB for Llama-3-8B, the default value size) is a new
``mmap`` from glibc every time (it serves 32 MiB and more that way), and every page of it
faults on the first write, which costs more than filling one already faulted in
(docs/benchmarks.md). Smaller buffers come from the heap and
are cheap; the pool still serves them, since taking one is cheaper than either.

A buffer returns to the pool only when the last object that can reach its bytes is gone
(the response was sent or dropped): each loan is a fresh numpy array over an anonymous
``mmap`` the pool keeps, and a ``weakref.finalize`` on that array gives the map back.
numpy slices and memoryviews of the array all keep the array itself alive (its base is
the map, not another array), so no byte is reused while anything still refers to it.
"""

from __future__ import annotations

import mmap
import threading
import weakref

import numpy as np
import numpy.typing as npt

IDLE_BYTES = 64 << 20
"""Idle buffers kept for reuse, in bytes (at least one buffer)."""


class ValueBuffers:
    """Buffers of ``nbytes`` each, lent as writable uint8 arrays. Thread-safe.

    Args:
        nbytes: the size of every buffer (the largest value a request may carry).
        idle_bytes: how many bytes of free buffers to keep; more are unmapped.
    """

    def __init__(self, nbytes: int, idle_bytes: int = IDLE_BYTES) -> None:
        self.nbytes = nbytes
        self.keep = max(1, idle_bytes // max(1, nbytes))
        self._free: list[mmap.mmap] = []
        self._lock = threading.Lock()
        self.created = 0

    def take(self, nbytes: int | None = None) -> npt.NDArray[np.uint8]:
        """A writable array of ``nbytes`` (default: the pool's size); its contents are
        whatever an earlier loan left. Beyond the pool's size: a plain new array."""
        n = self.nbytes if nbytes is None else nbytes
        if n > self.nbytes:
            return np.empty(n, dtype=np.uint8)
        with self._lock:
            mm = self._free.pop() if self._free else None
            if mm is None:
                self.created += 1
        if mm is None:
            mm = mmap.mmap(-1, max(1, self.nbytes), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        arr = np.frombuffer(mm, dtype=np.uint8, count=n)
        weakref.finalize(arr, self._give, mm)
        return arr

    def idle(self) -> int:
        """Free buffers held now."""
        with self._lock:
            return len(self._free)

    def _give(self, mm: mmap.mmap) -> None:
        with self._lock:
            if len(self._free) < self.keep:
                self._free.append(mm)
                return
        # Dropped: the map is unmapped once nothing refers to it (no view is left).
